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
can be preempted (``Scheduler.fits_without_preemption``) and every queued request's token can be
chosen on the device: greedily, or (where the runner launches ON_DEVICE steps: one device) by random
sampling or under a grammar (``SamplingParams.samples_on_device``: no logits processing, no
logprobs); otherwise the engine runs the step as usual.

A constrained row's mask for step N+1 needs the token of step N accepted by its grammar, so such a
step is launched without its tokens (``how=ON_DEVICE``): its forward runs on the device while the
host commits step N (advancing the grammars, whose next masks are then filled on a worker thread:
``pagoda.structured_outputs.mask_ahead``) and hands out N's outputs; the next call chooses N+1's
tokens (``choose_on_device``: masks applied and tokens picked on the device) before it launches N+2
fed from them. N+2 is scheduled and its launch staged (inputs built and uploaded: ``stage_launch``)
before N+1's tokens are chosen, so that the device goes from that choice to N+2's forward without
waiting for the host. A row its grammar leaves with no token fails when its step is committed.
"""

from __future__ import annotations

import itertools
import time
from typing import NamedTuple

import numpy as np
import torch

from pagoda.engine.sampling_batch import sampling_rows
from pagoda.engine.scheduler import PENDING_TOKEN, SchedulerOutput
from pagoda.engine.step_plan import ARGMAX, ON_DEVICE, plan_step
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
        self.pending = None  # (SchedulerOutput, PendingStep): launched and advanced, not committed
        self.launched_ahead = 0  # steps launched before their predecessor's tokens were known (stats)
        self.sampled_later = 0  # launched steps whose tokens were chosen after the previous step's commit
        self.timeline = None  # a pagoda.engine.timeline.StepTimeline marking each launch (profiling)

    def _launch(self, how: str, out: SchedulerOutput, feed=None, staged=None):
        begin = None if self.timeline is None else self.timeline.mark()
        runner = self.engine.runner
        # (only the single-device runner stages launches; tensor-parallel executors take no ``staged``)
        if staged is None:
            pending = runner.launch(plan_step(out), feed, how=how)
        else:  # (the plan the launch was staged from, and what staging prepared)
            pending = runner.launch(staged[0], feed, staged=staged[1], how=how)
        if begin is not None:
            self.timeline.add(out, begin, self.timeline.mark())
        return pending

    def _how(self) -> str | None:
        """How the next step's tokens are chosen: ARGMAX when every sequence that can be scheduled takes the
        argmax, ON_DEVICE (at the next call) when each samples on the device and the runner can, None when
        some request needs the host to choose its token."""
        sched, runner = self.engine.scheduler, self.engine.runner
        distinct = {id(s.params): s.params for s in itertools.chain(sched.running, sched.waiting)}.values()
        if all(p.argmax_only for p in distinct):
            return ARGMAX
        if ON_DEVICE in runner.launch_modes and all(p.samples_on_device for p in distinct):
            return ON_DEVICE
        return None

    def _sampled(self, out: SchedulerOutput, launched):
        """A launched step (``out``), its tokens chosen now if they were left for later: from its rows as
        they stand now (grammars advanced by the step before, sequences that ended since)."""
        if launched.waits_for_choice:
            self.sampled_later += 1
            self.engine.runner.choose_on_device(launched, sampling_rows([it.seq for it in out.scheduled
                                                                          if it.sample]))
        return launched

    def _feed_index(self, nxt: SchedulerOutput, out: SchedulerOutput, device) -> tuple | None:
        """The decodes of ``nxt`` whose input is a pending token of ``out``, as rows of nxt and indices
        into out's sampled tokens: (rows, indices) on ``device`` and both on the host, for a ``StepFeed``
        (None: there are none). Needs none of out's tokens."""
        index = {it.seq.seq_id: i for i, it in enumerate(it for it in out.scheduled if it.sample)}
        rows, picks = [], []
        for row, it in enumerate(nxt.scheduled[:nxt.num_decodes]):
            if it.seq.token_ids[-1] == PENDING_TOKEN:
                rows.append(row)
                picks.append(index[it.seq.seq_id])
        if not rows:
            return None
        host = np.array([rows, picks], dtype=np.int64)
        both = upload(host, device)  # not waiting for the step in flight
        return both[0], both[1], host

    def _schedule_ahead(self, ahead_ok: bool) -> tuple[SchedulerOutput, object] | None:
        """The next step and how its tokens are chosen, when it can be launched before this one's tokens are in."""
        sched = self.engine.scheduler
        how = self._how() if ahead_ok and sched.has_work_ahead() else None
        if how is None or not sched.fits_without_preemption():
            return None
        nxt = sched.schedule()
        if nxt.is_empty:
            return None
        self.engine.completion.mark_scheduled(nxt)
        return nxt, how

    def step(self, finished_only: bool) -> list | None:
        """One engine step through the pipeline; None when the usual path should run it."""
        eng = self.engine
        sched, runner = eng.scheduler, eng.runner
        t0 = time.perf_counter()
        # streamed outputs too unless async_scheduling is off (unset: on, wherever a pipeline exists)
        ahead_ok = finished_only or eng.config.async_scheduling is not False
        if self.pending is None:
            how = self._how() if ahead_ok else None
            if how is None:
                return None
            out = sched.schedule()
            t1 = time.perf_counter()
            if out.is_empty:
                return []
            eng.completion.mark_scheduled(out)
            pending = self._sampled(out, self._launch(how, out))
            sched.advance(out)
            nxt = self._schedule_ahead(ahead_ok)
            staged = index = None
        else:
            (out, launched), self.pending = self.pending, None
            nxt = staged = index = None
            early = launched.waits_for_choice and hasattr(runner, "stage_launch")
            if early:
                # Its tokens are chosen on the device once the grammars' masks are in, and the next step's
                # forward can only follow them: do the next launch's host work (scheduling, inputs, uploads)
                # first, so that the device goes from this step's choice to the next forward without
                # waiting for the host in between.
                nxt = self._schedule_ahead(ahead_ok)
                if nxt is not None:
                    plan = plan_step(nxt[0])
                    staged = plan, runner.stage_launch(plan)
                    index = self._feed_index(nxt[0], out, runner.device)
            pending = self._sampled(out, launched)  # (the grammars took the previous step's tokens)
            if not early:
                nxt = self._schedule_ahead(ahead_ok)
            t1 = t0
        ahead = None
        if nxt is not None:
            nxt, how = nxt
            if staged is None:
                index = self._feed_index(nxt, out, pending.tokens.device)
            feed = None if index is None else StepFeed(pending.tokens, *index)
            ahead = (nxt, self._launch(how, nxt, feed, staged))
            self.launched_ahead += 1
        result = runner.collect(pending)
        outputs = eng.completion.complete(out, result.tokens, None, finished_only, t0, t1, advanced=True,
                                          failed=result.failed)
        if ahead is not None:
            sched.advance(ahead[0])
            self.pending = ahead
        return outputs
