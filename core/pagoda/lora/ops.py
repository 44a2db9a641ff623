"""Torch reference of the batched LoRA ops (signatures shared with the Triton kernels of
pagoda-cuda, registered as kernel ops ``lora_shrink`` and ``lora_expand``).

Every token of the flattened batch carries the slot of its sequence's adapter (-1: the base
model). Adapter weights of one layer are stacked over slots:
  a_stack [S, R, K]  (the rank dim R holds every fused piece's A, piece i at rows i*r_max..)
  b_stack [S, N, R]  (block-diagonal over pieces; the scaling is folded in)
shrink:  h[p, t] = partial sums of x[t] @ a_stack[slot[t]].T over P slices of K
                                                   [T, K] -> [P, T, R] (float32; P >= 1)
expand:  y[t] += (sum over p of h[p, t]) @ b_stack[slot[t]].T     adds into y [T, N]
The partial sums let a kernel split K over programs when the batch is small (a decode step)
without an extra reduction launch: the expand adds them up as it reads them. This reference
returns P = 1. ``token_order`` (optional, [T] int64): the tokens sorted by slot, so that a
kernel's tile of consecutive entries mostly shares one adapter; the result does not depend on it.
Gather-based (BGMV-style): no host synchronisation, so a captured graph replays it.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 24  # gathered weight elements per chunk of tokens (bounds the temporary)


def _chunks(num_tokens: int, per_token: int):
    step = max(1, CHUNK_ELEMENTS // max(1, per_token))
    for start in range(0, num_tokens, step):
        yield start, min(num_tokens, start + step)


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, token_slots: torch.Tensor,
                token_order: torch.Tensor | None = None) -> torch.Tensor:
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
                token_order: torch.Tensor | None = None) -> torch.Tensor:
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


OPS = ("lora_shrink", "lora_expand")
