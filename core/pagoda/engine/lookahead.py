"""Decode lookahead: launch step N+1 on the device before step N's tokens reach the host.

In steady decoding (nothing waiting, every running sequence decoding, greedy sampling
without penalties or logprobs, all replayed from CUDA graphs) the next step's batch is
known before this step's tokens are: the same sequences, one position further, with the
tokens this step samples as inputs, which stay on the device. So the engine launches step
N+1 right behind step N and does step N's host work (stop checks, outputs, block
bookkeeping) while the device computes N+1; the host cost of a step leaves the critical
path.

Nothing changes in what is generated. A sequence that step N finishes by a length limit is
never speculated on (the next step is not launched); one that step N stops by EOS, a stop
token or a stop string has a token computed in N+1 that is thrown away (``Scheduler.update``
skips finished sequences; its cache slot is in a partial block, freed with the sequence, and
the stale write lands before any later step can reuse the block). Only offline batches use
it (``LLMEngine.step(finished_only=True)``, as ``LLM.generate`` does).
"""

from __future__ import annotations

import time

from pagoda.engine.scheduler import ScheduledSeq, SchedulerOutput
from pagoda.engine.sequence import SequenceStatus


class DecodeLookahead:
    def __init__(self, engine):
        self.engine = engine
        self.pending = None  # (SchedulerOutput, PendingDecode) launched but not collected
        self.launched_ahead = 0  # steps launched before their predecessor was collected (stats)

    def _plain(self, out: SchedulerOutput) -> bool:
        """A decode batch the graphs run, sampled greedily with nothing per-sequence."""
        graphs = self.engine.runner.graphs
        if out.preempted or graphs is None or not graphs.can_run(out):
            return False
        distinct = {id(it.seq.params): it.seq.params for it in out.scheduled}.values()
        return all(p.argmax_only for p in distinct)

    def _next_batch(self, out: SchedulerOutput) -> SchedulerOutput | None:
        """The step after ``out`` if it is certain (same sequences, no limits reached, a slot
        for each), with the blocks it needs allocated; else None."""
        eng = self.engine
        sched, bm = eng.scheduler, eng.block_manager
        seqs = [it.seq for it in out.scheduled]
        running = sched.running
        if sched.waiting or len(running) != len(seqs) or len(seqs) > sched.max_num_batched_tokens:
            return None
        max_len = sched.max_model_len
        block_size = bm.block_size
        new_blocks = 0
        for seq, other in zip(seqs, running):
            if seq is not other or seq.status is not SequenceStatus.RUNNING:
                return None
            num_tokens = len(seq.token_ids)
            limit = seq.params.max_tokens
            # after step N the sequence has one more token; a length stop there ends it
            if num_tokens + 1 >= max_len or (limit is not None and
                                             num_tokens + 1 - len(seq.prompt_token_ids) >= limit):
                return None
            new_blocks += bm.new_blocks_needed(seq, seq.num_computed_tokens + 2)
        if new_blocks > bm.num_free_blocks:
            return None
        if new_blocks:
            for seq in seqs:
                if (seq.num_computed_tokens + 2) > len(seq.block_table) * block_size:
                    bm.allocate_slots(seq, 2)  # covers the position step N+1 computes
        sched.stats.num_steps += 1
        n = len(seqs)
        return SchedulerOutput([ScheduledSeq(s, 1, True) for s in seqs], n, n)

    def step(self, finished_only: bool) -> list | None:
        """One engine step through the lookahead; None when the normal path should run it."""
        eng = self.engine
        runner = eng.runner
        t0 = time.perf_counter()
        if self.pending is None:
            if not finished_only:
                return None
            out = eng.scheduler.schedule()
            t1 = time.perf_counter()
            if out.is_empty:
                return []
            eng._mark_scheduled(out)
            if not self._plain(out):
                result = runner.execute(out)
                return eng._complete_step(out, result.tokens, result.logprobs, finished_only, t0, t1)
            pending = runner.launch_decode(out)
        else:
            out, pending = self.pending
            self.pending = None
            t1 = t0
        nxt = self._next_batch(out) if finished_only else None
        if nxt is not None:
            self.pending = (nxt, runner.launch_decode(nxt, ahead=1, input_ids=pending.tokens))
            self.launched_ahead += 1
        tokens = runner.collect_decode(pending)
        return eng._complete_step(out, tokens, None, finished_only, t0, t1)
