"""A step's grammar masks on its logits: rows filled ahead (``mask_ahead``) or now, one upload, one kernel.

The sampler hands over its constrained rows; each row's mask comes from the fill started ahead when
that is still valid, else it is filled here (a request's first constrained step, a stale or failed fill
ahead). The rows go to the device as they lie in the host buffer, narrower than the logits when the
library writes only the tokenizer's ids (xgrammar): the logits past them, ids a model pads its
vocabulary with, are set to -inf apart. xgrammar's kernel applies the masks in place (the kernel op
``apply_token_bitmask``: xgrammar's CPU path, or on CUDA its Triton kernel, launched by pagoda-cuda), for
both backends' masks (the same int32 bit layout).

A row whose mask allows no token at all is known on the host, from the mask itself: its request fails
(``fail_blocked`` in the sampler) without a read from the device.
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda import kernels
from pagoda.kernels.host_upload import upload
from pagoda.structured_outputs import backends
from pagoda.structured_outputs.backends import GrammarMatcher
from pagoda.structured_outputs.mask_ahead import MaskAhead, none_left


def apply_grammar_masks(logits: torch.Tensor, rows: list[tuple[int, GrammarMatcher, int | None]],
                        ahead: MaskAhead | None, failed: dict) -> list[int]:
    """Mask ``logits`` [R, V] in place for ``rows``: (row, its matcher, a token to allow besides the
    grammar's or None). Rows whose mask could not be filled join ``failed`` (row -> exception); returns
    the rows whose grammar allows no token."""
    width = (logits.shape[-1] + 31) // 32
    ready = ahead.take([m for _, m, _ in rows], width) if ahead is not None else None
    where = ready.where if ready is not None else [-1] * len(rows)
    todo = [k for k, w in enumerate(where) if w < 0]
    words = ready.bitmask.shape[1] if ready is not None else _words(rows[todo[0]][1], width)
    extra = None
    if todo:
        extra = torch.empty((len(todo), words), dtype=torch.int32)
        pairs = [(rows[k][1], i) for i, k in enumerate(todo)]
        try:  # all rows at once, on the grammar libraries' threads
            backends.fill_bitmasks(pairs, extra)
        except Exception:  # row by row, to pin the failure on its request
            for matcher, i in pairs:
                try:
                    matcher.fill_bitmask(extra, i)
                except Exception as exc:
                    failed[rows[todo[i]][0]] = exc
                    extra[i] = -1  # (its token is never used)
    # each row's place in the host rows uploaded below: the fill ahead's, then this step's
    first = ready.bitmask.shape[0] if ready is not None else 0
    source = list(where)
    for i, k in enumerate(todo):
        source[k] = first + i
    host = ready.bitmask if ready is not None else None
    empty = list(ready.none_left) if ready is not None else []
    if extra is not None:
        empty += none_left(extra)
        host = extra if host is None else torch.cat([host, extra])
    blocked = []
    for (row, _, opening), src in zip(rows, source):
        if opening is not None:  # e.g. the token opening the reasoning: allowed as well
            host[src, opening // 32] |= _bit(opening % 32)
        elif empty[src] and row not in failed:
            blocked.append(row)
    # the worker's buffer is page-locked already, as is a grammar process's shared memory where the platform could
    # pin it in place (copied as they are); rows filled here, or shared memory left pageable, go through upload,
    # which pins them first: a copy from pageable memory would wait for the device's queued work, i.e. the forward
    # launched ahead
    pinned = extra is None and ready.pinned
    device = host.to(logits.device, non_blocking=True) if pinned else upload(host.numpy(), logits.device)
    targets = [row for row, _, _ in rows]
    # the kernel's rows (padded where its kernel is Triton's: _kernel_rows), uploaded once for both uses below
    index = _rows_on(logits.device, targets if logits.device.type == "cpu" else _kernel_rows(targets))
    if source != targets:  # rows in another order than the logits': place them
        placed = torch.empty((logits.shape[0], words), dtype=torch.int32, device=logits.device)
        placed[index[:len(targets)]] = device[_on(logits.device, source)]
        device = placed
    vocab = min(logits.shape[-1], 32 * words)
    kernels.get_op("apply_token_bitmask")(logits, device, index, vocab)
    if vocab < logits.shape[-1]:  # ids past the tokenizer's: never allowed
        span = backends.row_index(targets)
        if isinstance(span, slice):  # (the usual batch: views and a fill; indexing was 14% of the mask step on CUDA)
            logits.narrow(0, span.start, span.stop - span.start).narrow(1, vocab, logits.shape[-1] - vocab) \
                .fill_(float("-inf"))
        else:
            logits[span, vocab:] = float("-inf")
    return blocked


KERNEL_ROWS = 16  # the mask kernel's row count is padded to a multiple of this (see _kernel_rows)


def _kernel_rows(targets: list[int]) -> list[int]:
    """The logits rows the mask kernel is given: ``targets`` with the last one repeated up to a multiple of
    ``KERNEL_ROWS`` (masking a row twice with its own mask changes nothing; the CPU's kernel gets them as they
    are). xgrammar's CUDA kernel is Triton,
    which compiles a variant per kind of row count (1, a multiple of 16, any other; with and without an index):
    given any count, a server compiled up to six of them while serving, each stalling every stream for a
    fraction of a second. Always an index, always a multiple of 16: one variant, compiled at the first
    constrained step."""
    pad = -len(targets) % KERNEL_ROWS
    return targets + targets[-1:] * pad


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, vocab_size: int) -> None:
    """The kernel op ``apply_token_bitmask`` (the reference, every platform): ``logits[r, t] = -inf`` for each
    row ``r`` of ``rows`` (int32, on the logits' device) and each id ``t < vocab_size`` whose bit in
    ``bitmask[r]`` (int32 words, on the same device) is 0: xgrammar's ``apply_token_bitmask_inplace``, its CPU
    path or its kernel for the device. pagoda-cuda registers a launch of the same Triton kernel without the
    wrapper's work per call (device queries, a copy of the row index)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)


_last_rows: list = [((None, None), None)]  # ((device, rows), their tensor): a batch's constrained rows rarely change


def _rows_on(device, rows: list[int]) -> torch.Tensor:
    """``rows`` as int32 on ``device``, the last upload reused while the rows stay the same (read only; the
    key and its tensor are one tuple, read and replaced whole, so engines on other threads cannot mix them)."""
    key = (device, rows)
    last = _last_rows[0]
    if last[0] == key:
        return last[1]
    tensor = _on(device, rows, np.int32)
    _last_rows[0] = (key, tensor)
    return tensor


def _words(matcher: GrammarMatcher, width: int) -> int:
    """Words per row the matcher's library writes (xgrammar: the tokenizer's ids), at most ``width``."""
    return min(getattr(matcher, "words", None) or width, width)


def _on(device, values: list, dtype=np.int64) -> torch.Tensor:
    return upload(np.asarray(values, dtype=dtype), device)


def _bit(i: int) -> int:
    """Bit i of an int32 word, as a signed value (bit 31 is the sign)."""
    return (1 << i) - (1 << 32 if i == 31 else 0)
