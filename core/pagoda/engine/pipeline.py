"""Step pipeline: launch step N+1 on the device before step N's tokens reach the host.

Offline batches of greedy requests (``LLM.generate``: ``LLMEngine.step(finished_only=True)``), and
streamed steps (``finished_only=False``: the server) unless the engine key ``async_scheduling`` is
false (on by default since it was measured on an H200: docs/benchmarks.md), on a platform that
queues work asynchronously (``Platform.supports_async_steps``), on one device or several
tensor-parallel ranks alike (the executor sends each launch and its feed to every rank; each
rank feeds its own copy of the previous step's tokens). After step N is launched the scheduler
advances as if it had run (``Scheduler.advance``): its chunks count as computed and every sequence
that samples holds a ``PENDING_TOKEN``. Step N+1 is then scheduled and launched right away; the
decodes whose input is a pending token take it from N's tokens on the device. Only then does the
host wait for N's tokens, write them in (``Scheduler.commit``: stops, outputs) and advance N+1. The
host work of a step (scheduling, building inputs, launching an eager prefill, stop checks) leaves
the critical path for prefill steps as well as for graph-replayed decodes.

Outputs of step N (streamed or finished) are built while committing N, before N+1 is advanced, so
they never hold a pending token; a request added meanwhile is scheduled from step N+2.

Nothing changes in what is generated. A sequence whose pending token reaches a length limit
is not scheduled again (``Scheduler.ends_by_length``). One that stops by EOS, a stop token or
a stop string had a token computed in N+1 that is thrown away (``commit`` skips ended
sequences; the cache slot it wrote is in a block freed with the sequence, and the write lands
before any later step can reuse the block). Steps are only scheduled ahead when no sequence
can be preempted (``Scheduler.fits_without_preemption``) and every queued request samples
greedily without penalties or logprobs; otherwise the engine runs the step as usual.
"""

from __future__ import annotations

import itertools
import time
from typing import NamedTuple

import numpy as np
import torch

from pagoda.engine.scheduler import PENDING_TOKEN, SchedulerOutput
from pagoda.kernels.host_upload import upload


class StepFeed(NamedTuple):
    """The decode rows of a launched step whose input is a token of the step launched before it."""

    tokens: torch.Tensor  # [s] that step's sampled tokens, on the device
    rows: torch.Tensor  # [k] rows of this step (device)
    indices: torch.Tensor  # [k] their tokens' indices into ``tokens`` (device)
    host: np.ndarray  # [2, k] rows and indices on the host (for the other tensor-parallel ranks)


class StepPipeline:
    def __init__(self, engine):
        self.engine = engine
        self.pending = None  # (SchedulerOutput, PendingDecode): launched and advanced, not committed
        self.launched_ahead = 0  # steps launched before their predecessor's tokens were known (stats)
        self.timeline = None  # a pagoda.engine.timeline.StepTimeline marking each launch (profiling)

    def _launch(self, out: SchedulerOutput, feed=None):
        if self.timeline is None:
            return self.engine.runner.launch(out, feed)
        begin = self.timeline.mark()
        pending = self.engine.runner.launch(out, feed)
        self.timeline.add(out, begin, self.timeline.mark())
        return pending

    def _plain(self) -> bool:
        """Whether every sequence that can be scheduled samples greedily with nothing per-sequence."""
        sched = self.engine.scheduler
        distinct = {id(s.params): s.params for s in itertools.chain(sched.running, sched.waiting)}.values()
        return all(p.argmax_only for p in distinct)

    def _feed(self, nxt: SchedulerOutput, out: SchedulerOutput, tokens: torch.Tensor) -> StepFeed | None:
        """The decodes of ``nxt`` whose input is a pending token of ``out``, as rows of nxt and
        indices into out's sampled tokens (None: there are none)."""
        index = {it.seq.seq_id: i for i, it in enumerate(it for it in out.scheduled if it.sample)}
        rows, picks = [], []
        for row, it in enumerate(nxt.scheduled[:nxt.num_decodes]):
            if it.seq.token_ids[-1] == PENDING_TOKEN:
                rows.append(row)
                picks.append(index[it.seq.seq_id])
        if not rows:
            return None
        host = np.array([rows, picks], dtype=np.int64)
        both = upload(host, tokens.device)  # not waiting for the step in flight
        return StepFeed(tokens, both[0], both[1], host)

    def step(self, finished_only: bool) -> list | None:
        """One engine step through the pipeline; None when the usual path should run it."""
        eng = self.engine
        sched, runner = eng.scheduler, eng.runner
        t0 = time.perf_counter()
        # streamed outputs too unless async_scheduling is off (unset: on, wherever a pipeline exists)
        ahead_ok = finished_only or eng.config.async_scheduling is not False
        if self.pending is None:
            if not ahead_ok or not self._plain():
                return None
            out = sched.schedule()
            t1 = time.perf_counter()
            if out.is_empty:
                return []
            eng._mark_scheduled(out)
            pending = self._launch(out)
            sched.advance(out)
        else:
            (out, pending), self.pending = self.pending, None
            t1 = t0
        ahead = None
        if ahead_ok and sched.has_work_ahead() and self._plain() and sched.fits_without_preemption():
            nxt = sched.schedule()
            if not nxt.is_empty:
                eng._mark_scheduled(nxt)
                ahead = (nxt, self._launch(nxt, self._feed(nxt, out, pending.tokens)))
                self.launched_ahead += 1
        tokens = runner.collect_decode(pending)
        outputs = eng._complete_step(out, tokens, None, finished_only, t0, t1, advanced=True)
        if ahead is not None:
            sched.advance(ahead[0])
            self.pending = ahead
        return outputs
