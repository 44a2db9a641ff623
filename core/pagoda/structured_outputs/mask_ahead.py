"""Grammar masks filled ahead of their step, while the engine does the rest of its host work.

A constrained sequence's next token mask depends only on the tokens its grammar has accepted, and
those are known as soon as a step's tokens are in (``RequestControls.advance``). Filling the masks
then, on a worker thread, lets the grammar library work while the engine builds the step's outputs,
hands them to the server, schedules the next step and launches its forward: xgrammar's batched fill
and llguidance's parallel fill run natively without the GIL, so the two overlap for real once the
worker has started, which needs the GIL: ``start`` hands it over at once (without that, the worker
began only when the engine thread next blocked, i.e. at the sampler's wait; scripts/mask_ahead_bench.py
measures it). The worker needs the GIL once more when the fill is done, to hand its rows back, and
CPython gives a waiting thread the GIL only when the holder blocks or after the switch interval (5 ms
by default: longer than a step); so while fills run ahead the interval is 0.2 ms (``SWITCH_INTERVAL``),
and the rows are usually handed back before the sampler asks for them (``take`` then needs no switch to
the worker and back). Every time the worker takes the GIL the engine thread waits for it, so the worker
runs as little Python as it can (``_Worker``: no executor, no future; the rows' checks on the engine
thread). A py-spy profile of the server on an H100 (docs/benchmarks.md, twenty-fourth session) showed
the hand-over in ``start`` and the worker's waits for the GIL after its fill as the costliest parts.
Matchers in a grammar process (``grammar_process``: the default on GPUs) need no worker: ``start`` sends the
fill to that process, which also accepted the tokens, and ``wait`` reads its reply (rows in shared memory).

The worker writes straight into a host buffer the device copies from without waiting (page-locked on a
GPU: ``Platform.host_buffer``), rows as wide as the library writes them (xgrammar: the tokenizer's ids,
often a third of the model's vocabulary). The sampler takes the buffer as it is (``take``: which of its
rows are still valid, i.e. the same matcher with no token accepted since, and which allow no token at
all) and uploads it in one copy; it fills only the other rows itself. Two buffers
take turns, so a fill never writes into rows a copy of the step before may still be reading.

    ahead = MaskAhead(host_buffer, pin_in_place)  # the platform's: page-locked rows, as they lie
    ahead.start(sequences, broken)            # after a step: their grammars just advanced
    ready = ahead.take(rows)                  # in the sampler: the filled rows, where each of ``rows`` is
    ahead.wait()                              # before any matcher advances again
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from queue import SimpleQueue
from typing import NamedTuple

import numpy as np
import torch

from pagoda.structured_outputs.backends import GrammarMatcher, prepared_fill

logger = logging.getLogger("pagoda")
SWITCH_INTERVAL = 0.0002  # seconds: CPython's GIL switch interval while fills run ahead (see the docstring)
_switch_lock = threading.Lock()
_switch_users = [0, None]  # MaskAheads with a worker; the interval before the first of them


class ReadyMasks(NamedTuple):
    """Rows filled ahead, as the sampler takes them."""

    bitmask: torch.Tensor  # int32 [F, w]: the fill's rows (in the host buffer; valid until the next start)
    where: list[int]  # for each row asked for: its row in ``bitmask``, or -1 (to fill in the step)
    none_left: list[bool]  # per row of ``bitmask``: the grammar allows no token at all
    pinned: bool  # ``bitmask`` lies in page-locked memory (else shared memory the platform could not pin in place)


class MaskAhead:
    def __init__(self, host_buffer: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
                 pin_in_place: Callable[[torch.Tensor], Callable[[], None] | None] | None = None):
        self._host_buffer = host_buffer or (lambda shape, dtype: torch.zeros(shape, dtype=dtype))
        self._pin_in_place = pin_in_place  # (Platform.pin_in_place: for a grammar process's shared rows)
        self._buffers: list[torch.Tensor | None] = [None, None]  # taking turns (see the module docstring)
        self._turn = 0
        self._worker: _Worker | None = None  # started with the first constrained step
        self._job: _Job | None = None
        self._ready: torch.Tensor | None = None  # the finished job's rows
        self._none_left: list[bool] | None = None  # which of them allow no token, where the job says
        self._pinned = True  # whether they lie in a buffer of ``host_buffer``
        self._rows: dict[int, tuple[int, int]] = {}  # id(matcher) -> (row in the job's mask, tokens accepted)
        self._matchers: list[GrammarMatcher] = []  # kept alive while their ids are keys above
        self.width: int | None = None  # words per mask row (the model's vocabulary / 32), from the sampler
        self.rows_used = 0  # rows the sampler took from a fill ahead (tests, stats)
        self.wait_seconds = 0.0  # host time spent waiting for fills ahead to end (stats: fill_wait_seconds)

    def start(self, seqs, broken=()) -> None:
        """Fill the next masks of these sequences' grammars on the worker thread: those still running,
        not of a ``broken`` request and not complete (nothing before the sampler has told the
        vocabulary width, i.e. before any constrained step: unconstrained engines pay nothing)."""
        if self.width is None:
            return
        live = [s.grammar for s in seqs if s.grammar is not None and not s.grammar.terminated
                and not s.is_finished and s.request_id not in broken]
        if not live:
            return
        self.wait()
        self._ready = None
        self._rows = {id(m): (i, m.accepted) for i, m in enumerate(live)}
        self._matchers = live
        client = getattr(live[0], "client", None)
        if client is not None and all(getattr(m, "client", None) is client for m in live):
            self._turn ^= 1  # matchers in a grammar process: it fills, no thread of this one
            try:
                self._job = client.fill_ahead(live, self._turn, self._pin_in_place)
            except Exception as exc:  # noqa: BLE001 - the sampler's own fill reports it per row
                logger.debug("grammar masks not filled ahead (%s); the step fills them", exc)
                self._rows, self._matchers = {}, []
            return
        if self._worker is None:
            self._worker = _Worker()
            _shorter_switch(True)
        # Rows as wide as the library writes them, so that the worker runs nothing but the library's fill.
        words = {getattr(m, "words", None) for m in live}
        width = min(words.pop() if len(words) == 1 and None not in words else self.width, self.width)
        bitmask = self._buffer(len(live), width)  # (every row written whole)
        try:  # (the fill's arguments made here: the worker goes straight to the library's native fill)
            fill = prepared_fill([(m, i) for i, m in enumerate(live)], bitmask)
        except Exception as exc:  # noqa: BLE001 - the sampler's own fill reports it per row
            logger.debug("grammar masks not filled ahead (%s); the step fills them", exc)
            self._rows, self._matchers = {}, []
            return
        self._job = self._worker.submit(fill, bitmask)
        # The worker needs the GIL to start the fill (whose native part then runs without it): hand it
        # over now, or it waits until this thread next blocks, which is the sampler's wait for this fill
        # (measured: a fill started ahead of 3 ms of the engine's host work was not begun by then).
        time.sleep(0)

    def _buffer(self, rows: int, width: int) -> torch.Tensor:
        """The next host buffer's first ``rows`` rows of ``width`` words (contiguous), grown as needed."""
        self._turn ^= 1
        buf = self._buffers[self._turn]
        if buf is None or buf.shape[0] < rows or buf.shape[1] != width:
            buf = self._buffers[self._turn] = self._host_buffer((max(rows, 64), width), torch.int32)
        return buf[:rows]

    def wait(self) -> None:
        """Wait for the fill in flight (before a matcher may advance). A fill that failed leaves
        nothing: the sampler then fills every row itself and pins the failure on its request."""
        job, self._job = self._job, None
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            self._ready, self._none_left = job.result()
            self._pinned = job.pinned
        except Exception as exc:  # noqa: BLE001 - the sampler's own fill reports it per row
            logger.debug("grammar masks filled ahead failed (%s); the step fills them", exc)
            self._ready, self._rows, self._matchers = None, {}, []
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def take(self, rows: list[GrammarMatcher], width: int) -> ReadyMasks | None:
        """The rows filled ahead for the matchers ``rows`` (in the sampler's order) of a mask ``width``
        words wide (the model's vocabulary); None when there are none. A row counts only if its matcher
        accepted no token since the fill started."""
        self.width = width
        self.wait()
        ready, known, empty = self._ready, self._rows, self._none_left
        self._ready, self._rows, self._matchers, self._none_left = None, {}, [], None
        if ready is None or ready.shape[1] > width:
            return None
        where = []
        for matcher in rows:
            entry = known.get(id(matcher))
            valid = entry is not None and entry[1] == matcher.accepted and matcher.error is None
            where.append(entry[0] if valid else -1)
        used = sum(1 for w in where if w >= 0)
        if not used:
            return None
        self.rows_used += used
        # (a grammar process says which rows allow no token; a worker's rows are checked here, where it needs
        # no GIL for it)
        return ReadyMasks(ready, where, empty if empty is not None else none_left(ready), self._pinned)

    def close(self) -> None:
        self.wait()
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
            _shorter_switch(False)


class _Job:
    __slots__ = ("fill", "bitmask", "error", "done")
    pinned = True  # (its rows lie in the platform's host buffer)

    def __init__(self, fill: Callable[[], None], bitmask: torch.Tensor):
        self.fill, self.bitmask, self.error = fill, bitmask, None
        self.done = threading.Lock()
        self.done.acquire()  # released when the fill is over

    def result(self) -> tuple[torch.Tensor, None]:
        """The filled rows (and None: their empty rows are not known yet), once the fill is over."""
        self.done.acquire()  # (released by the worker when the fill returns or raises)
        if self.error is not None:
            raise self.error
        return self.bitmask, None


class _Worker:
    """The thread that runs the fills. Each time it needs the GIL it takes it from the engine thread, so it
    runs as little Python as it can: a C queue's ``get``, the prepared fill (the library's native fill, run
    without the GIL), a lock's release; the engine thread checks the rows itself (``none_left``)."""

    def __init__(self):
        self._jobs: SimpleQueue = SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pagoda-grammar-mask", daemon=True)
        self._thread.start()

    def submit(self, fill: Callable[[], None], bitmask: torch.Tensor) -> _Job:
        job = _Job(fill, bitmask)
        self._jobs.put(job)
        return job

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        get = self._jobs.get
        while (job := get()) is not None:
            try:
                job.fill()
            except BaseException as exc:  # noqa: BLE001 - handed to the engine thread (MaskAhead.wait)
                job.error = exc
            job.done.release()


def _shorter_switch(on: bool) -> None:
    """The GIL switch interval at most ``SWITCH_INTERVAL`` while any MaskAhead has a worker (``on``: one more
    has), the process's own interval back after the last."""
    with _switch_lock:
        if on:
            _switch_users[0] += 1
            if _switch_users[0] == 1:
                _switch_users[1] = sys.getswitchinterval()
                sys.setswitchinterval(min(_switch_users[1], SWITCH_INTERVAL))
        else:
            _switch_users[0] -= 1
            if _switch_users[0] == 0:
                sys.setswitchinterval(_switch_users[1])


def none_left(bitmask: torch.Tensor) -> list[bool]:
    """Per row of ``bitmask``: no bit set (the grammar allows no token). (numpy, on 64-bit words where the row
    allows: a tenth of torch's time, 7 against 12 us for 64 rows of SmolLM2's 49,152 ids here)"""
    words = bitmask.numpy()
    if words.shape[1] % 2 == 0 and words.strides[1] == 4 and words.strides[0] % 8 == 0:
        words = words.view(np.int64)
    return (np.bitwise_or.reduce(words, axis=1) == 0).tolist()
