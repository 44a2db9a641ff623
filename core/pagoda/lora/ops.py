"""Torch reference of the batched LoRA ops (signatures shared with the Triton kernels of
pagoda-cuda, registered as kernel ops ``lora_shrink``, ``lora_expand`` and ``lora_fused``).

Every token of the flattened batch carries the slot of its sequence's adapter (-1: the base
model). Adapter weights of one layer are stacked over slots:
  a_stack [S, R, K]  (the rank dim R holds every fused piece's A, piece i at rows i*r_max..)
  b_stack [S, N, R]  (block-diagonal over pieces; the scaling is folded in)
shrink:  h[p, t] = partial sums of x[t] @ a_stack[slot[t]].T over P slices of K
                                                   [T, K] -> [P, T, R] (float32; P >= 1;
                                                   a base token's rows are unspecified)
expand:  y[t] += (sum over p of h[p, t]) @ b_stack[slot[t]].T     adds into y [T, N]
fused:   y[t] += (x[t] @ a_stack[slot[t]].T) @ b_stack[slot[t]].T   both in one op (a kernel: one
                                                   launch, h never leaves the program)
The partial sums let a kernel split K over programs when the batch is small (a decode step)
without an extra reduction launch: the expand adds them up as it reads them. This reference
returns P = 1. Optional, for kernels (the result does not depend on them): ``token_order`` [T]
int64, the tokens sorted by slot, and ``tiles`` [3, NT] int64 (``token_tiles``): runs of at most
TILE_TOKENS sorted tokens that share one adapter, as (start in the order, length, slot), so that
each kernel program multiplies one adapter's weights (SGMV); zero-length tiles pad a fixed grid.
``lora_fused`` also takes ``piece_sizes``: the output widths of a fused layer's pieces (q/k/v,
gate/up) when ``b_stack`` is block-diagonal over them (piece i's rows use only rank columns
i*R/len(piece_sizes)..), so that a kernel can skip the zero blocks; the result does not depend on it.
Gather-based (BGMV-style): no host synchronisation, so a captured graph replays it.

A platform may also register ``lora_expand_stacked`` (pagoda-cuda does): for a layer whose plain weight W
[N, K] lies above every slot's A in one tensor [N + S*R, K] (``LoRALinearMethod.stack_weights``), one GEMM
gives the base output and every slot's shrink, out [T, N + S*R]; the op then adds each adapted token's
out[t, N + slot*R..] @ b_stack[slot].T into out[:, :N] in place and returns that view. A decode-sized step
then pays a few extra rows of the GEMM (which reads the weight anyway) and a short expand instead of a
shrink that reads K serially; the reference below states its result.
"""

from __future__ import annotations

import numpy as np
import torch

TILE_TOKENS = 16  # tokens per tile (the smallest row count of a tensor-core product)

CHUNK_ELEMENTS = 1 << 24  # gathered weight elements per chunk of tokens (bounds the temporary)


def _chunks(num_tokens: int, per_token: int):
    step = max(1, CHUNK_ELEMENTS // max(1, per_token))
    for start in range(0, num_tokens, step):
        yield start, min(num_tokens, start + step)


def max_tiles(num_tokens: int, num_slots: int) -> int:
    """Tiles ``token_tiles`` can make of ``num_tokens`` tokens over ``num_slots`` adapters: every
    adapter's run may end in a partial tile."""
    return -(-num_tokens // TILE_TOKENS) + num_slots


def token_tiles(sorted_slots: np.ndarray, pad_to: int | None = None) -> np.ndarray:
    """[3, NT] int64 (start, length, slot) tiles over the slots of the tokens in slot order
    (-1, the base, makes no tile); ``pad_to`` appends zero-length tiles up to that many."""
    n = len(sorted_slots)
    change = np.flatnonzero(np.diff(sorted_slots)) + 1
    starts = np.concatenate([[0], change]).astype(np.int64) if n else np.zeros(0, np.int64)
    ends = np.concatenate([change, [n]]).astype(np.int64) if n else np.zeros(0, np.int64)
    keep = sorted_slots[starts] >= 0 if n else np.zeros(0, bool)
    starts, ends = starts[keep], ends[keep]
    counts = -(-(ends - starts) // TILE_TOKENS)
    segment = np.repeat(np.arange(len(starts)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    tile_start = starts[segment] + within * TILE_TOKENS
    tiles = np.stack([tile_start, np.minimum(TILE_TOKENS, ends[segment] - tile_start),
                      np.asarray(sorted_slots, np.int64)[starts][segment]]).astype(np.int64)
    if pad_to is not None:
        if tiles.shape[1] > pad_to:
            raise ValueError(f"{tiles.shape[1]} LoRA tiles, more than the {pad_to} provided for")
        tiles = np.concatenate([tiles, np.zeros((3, pad_to - tiles.shape[1]), np.int64)], axis=1)
    return tiles


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, token_slots: torch.Tensor,
                token_order: torch.Tensor | None = None, tiles: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K], a_stack [S, R, K], token_slots [T] (int, -1 = none) -> [1, T, R] float32."""
    t = x.shape[0]
    out = torch.zeros(t, a_stack.shape[1], dtype=torch.float32, device=x.device)
    valid = (token_slots >= 0).unsqueeze(1)
    slots = token_slots.clamp(min=0).long()
    for s, e in _chunks(t, a_stack.shape[1] * a_stack.shape[2]):
        a = a_stack.index_select(0, slots[s:e]).float()  # [C, R, K]
        h = torch.bmm(a, x[s:e].float().unsqueeze(2)).squeeze(2)
        out[s:e] = torch.where(valid[s:e], h, 0.0)
    return out.unsqueeze(0)


def lora_expand(y: torch.Tensor, h: torch.Tensor, b_stack: torch.Tensor, token_slots: torch.Tensor,
                token_order: torch.Tensor | None = None, tiles: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, N] (updated in place and returned), h [P, T, R] float32 partial sums, b_stack [S, N, R]."""
    t = y.shape[0]
    h = h.sum(0)
    valid = (token_slots >= 0).unsqueeze(1)
    slots = token_slots.clamp(min=0).long()
    for s, e in _chunks(t, b_stack.shape[1] * b_stack.shape[2]):
        b = b_stack.index_select(0, slots[s:e]).float()  # [C, N, R]
        d = torch.bmm(b, h[s:e].unsqueeze(2)).squeeze(2)
        y[s:e] += torch.where(valid[s:e], d, 0.0).to(y.dtype)
    return y


def lora_fused(x: torch.Tensor, y: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
               token_slots: torch.Tensor, token_order: torch.Tensor | None = None, tiles: torch.Tensor | None = None,
               piece_sizes: tuple[int, ...] | None = None) -> torch.Tensor:
    """y [T, N] += (x [T, K] @ a_stack[slot].T) @ b_stack[slot].T per token (in place; returned)."""
    return lora_expand(y, lora_shrink(x, a_stack, token_slots), b_stack, token_slots)


def lora_expand_stacked(out: torch.Tensor, n: int, b_stack: torch.Tensor, token_slots: torch.Tensor,
                        token_order: torch.Tensor | None = None, tiles: torch.Tensor | None = None,
                        piece_sizes: tuple[int, ...] | None = None) -> torch.Tensor:
    """out [T, n + S*R] (the stacked GEMM's output: base output, then each slot's h) -> out[:, :n] with
    each adapted token's h[slot] @ b_stack[slot].T added, in place."""
    t, (s, _, r) = out.shape[0], b_stack.shape
    y = out[:, :n]
    valid = (token_slots >= 0).unsqueeze(1)
    slots = token_slots.clamp(min=0).long()
    h = out[:, n:].reshape(t, s, r)[torch.arange(t, device=out.device), slots]  # [T, R]
    for start, end in _chunks(t, b_stack.shape[1] * r):
        b = b_stack.index_select(0, slots[start:end]).float()  # [C, N, R]
        d = torch.bmm(b, h[start:end].float().unsqueeze(2)).squeeze(2)
        y[start:end] += torch.where(valid[start:end], d, 0.0).to(y.dtype)
    return y


def two_kernel_update(shrink, expand):
    """``lora_fused``'s signature over a platform's ``lora_shrink`` and ``lora_expand`` (two launches)."""
    def update(x, y, a_stack, b_stack, token_slots, token_order=None, tiles=None, piece_sizes=None):
        h = shrink(x, a_stack, token_slots, token_order, tiles)
        return expand(y, h, b_stack, token_slots, token_order, tiles)
    return update


OPS = ("lora_shrink", "lora_expand", "lora_fused")
