"""Grammar masks filled ahead of their step, while the engine does the rest of its host work.

A constrained sequence's next token mask depends only on the tokens its grammar has accepted, and
those are known as soon as a step's tokens are in (``RequestControls.advance``). Filling the masks
then, on a worker thread, lets the grammar library work while the engine builds the step's outputs,
hands them to the server, schedules the next step and launches its forward: xgrammar's batched fill
and llguidance's parallel fill run natively without the GIL, so the two overlap for real once the
worker has started, which needs the GIL: ``start`` hands it over at once (without that, the worker
began only when the engine thread next blocked, i.e. at the sampler's wait; scripts/mask_ahead_bench.py
measures it). The sampler of the next step takes the rows that are still valid (the same matcher, no token accepted
since) and fills only the others itself, as before.

    ahead = MaskAhead()
    ahead.start(sequences, broken)      # after a step: their grammars just advanced
    missing = ahead.take(bitmask, rows) # in the sampler: rows filled ahead are copied in
    ahead.wait()                        # before any matcher advances again
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pagoda.structured_outputs.backends import GrammarMatcher, fill_bitmasks, row_index

logger = logging.getLogger("pagoda")


class MaskAhead:
    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None  # started with the first constrained step
        self._job: Future | None = None
        self._ready: torch.Tensor | None = None  # the finished job's mask
        self._rows: dict[int, tuple[int, int]] = {}  # id(matcher) -> (row in the job's mask, tokens accepted)
        self._matchers: list[GrammarMatcher] = []  # kept alive while their ids are keys above
        self.width: int | None = None  # words per mask row (the model's vocabulary / 32), from the sampler
        self.rows_used = 0  # rows the sampler took from a fill ahead (tests, stats)

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
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagoda-grammar-mask")
        self._rows = {id(m): (i, m.accepted) for i, m in enumerate(live)}
        self._matchers = live
        # Rows as wide as the library writes them (xgrammar: the tokenizer's ids), so that the worker runs
        # nothing but the library's fill; ``take`` widens them to the model's vocabulary as it copies.
        words = {getattr(m, "words", None) for m in live}
        width = words.pop() if len(words) == 1 and None not in words else self.width
        bitmask = torch.empty((len(live), min(width, self.width)), dtype=torch.int32)  # (every row written whole)
        self._job = self._pool.submit(_fill, [(m, i) for i, m in enumerate(live)], bitmask)
        # The worker needs the GIL to start the fill (whose native part then runs without it): hand it
        # over now, or it waits until this thread next blocks, which is the sampler's wait for this fill
        # (measured: a fill started ahead of 3 ms of the engine's host work was not begun by then).
        time.sleep(0)

    def wait(self) -> None:
        """Wait for the fill in flight (before a matcher may advance). A fill that failed leaves
        nothing: the sampler then fills every row itself and pins the failure on its request."""
        job, self._job = self._job, None
        if job is None:
            return
        try:
            self._ready = job.result()
        except Exception as exc:  # noqa: BLE001 - the sampler's own fill reports it per row
            logger.debug("grammar masks filled ahead failed (%s); the step fills them", exc)
            self._ready, self._rows, self._matchers = None, {}, []

    def take(self, bitmask: torch.Tensor, rows: list[tuple[GrammarMatcher, int]]) -> list[tuple[GrammarMatcher, int]]:
        """Copy the rows filled ahead into ``bitmask`` (int32 [n, words]); return the (matcher, row)
        pairs still to fill. A row counts only if its matcher accepted no token since."""
        self.width = bitmask.shape[1]
        self.wait()
        ready, known = self._ready, self._rows
        self._ready, self._rows, self._matchers = None, {}, []
        if ready is None or ready.shape[1] > bitmask.shape[1]:
            return rows
        missing, dst, src = [], [], []
        for matcher, row in rows:
            entry = known.get(id(matcher))
            if entry is not None and entry[1] == matcher.accepted:
                dst.append(row)
                src.append(entry[0])
            else:
                missing.append((matcher, row))
        if dst:
            index, w = row_index(dst), ready.shape[1]
            bitmask[index, :w] = ready[row_index(src)]
            bitmask[index, w:] = 0  # the model's ids past the tokenizer's are never allowed
            self.rows_used += len(dst)
        return missing

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def _fill(pairs: list[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> torch.Tensor:
    fill_bitmasks(pairs, bitmask)
    return bitmask
