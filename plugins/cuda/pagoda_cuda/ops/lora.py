"""Batched LoRA shrink and expand (BGMV-style): every token gathers its own adapter's weights by
slot, so one launch serves a batch that mixes adapters (and base rows, slot -1, which add nothing).
Signatures and shapes: ``pagoda.lora.ops`` (the torch reference):
  shrink  x [T, K] @ a_stack[slot].T -> h [T, R] float32        grid (T, R / BLOCK_R)
  expand  y [T, N] += h [T, R] @ b_stack[slot].T                 grid (T, N / BLOCK_N)
The adapter weights of a layer are small (R x K), so they stay in L2 across the batch's tokens.
Arithmetic is float32 (loads are upcast first)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 128
BLOCK_N = 64


@triton.jit
def _shrink_kernel(x_ptr, x_stride, a_ptr, a_slot_stride, a_row_stride, slots_ptr, h_ptr, h_stride,
                   K: tl.constexpr, R, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # K (a layer's input width) is a compile-time constant: a handful per model
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    valid = slot >= 0
    slot = tl.maximum(slot, 0)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * x_stride + cols, mask=(cols < K) & valid, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * a_slot_stride + rows[:, None] * a_row_stride + cols[None, :],
                    mask=(rows[:, None] < R) & (cols[None, :] < K) & valid, other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + t * h_stride + rows, acc, mask=rows < R)


@triton.jit
def _expand_kernel(y_ptr, y_stride, h_ptr, h_stride, b_ptr, b_slot_stride, b_row_stride, slots_ptr, N, R,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    valid = slot >= 0
    slot = tl.maximum(slot, 0)
    ranks = tl.arange(0, BLOCK_R)
    h = tl.load(h_ptr + t * h_stride + ranks, mask=(ranks < R) & valid, other=0.0)
    b = tl.load(b_ptr + slot * b_slot_stride + cols[:, None] * b_row_stride + ranks[None, :],
                mask=(cols[:, None] < N) & (ranks[None, :] < R) & valid, other=0.0).to(tl.float32)
    delta = tl.sum(b * h[None, :], axis=1)
    out = y_ptr + t * y_stride + cols
    y = tl.load(out, mask=(cols < N) & valid, other=0.0).to(tl.float32)
    tl.store(out, (y + delta).to(y_ptr.dtype.element_ty), mask=(cols < N) & valid)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a_stack [S, R, K], token_slots [T] (-1: none) -> h [T, R] float32."""
    x, a_stack = _rows(x), a_stack.contiguous()
    t, k = x.shape
    r = a_stack.shape[1]
    h = torch.empty(t, r, dtype=torch.float32, device=x.device)
    if t:
        block_r = min(64, triton.next_power_of_2(r))
        _shrink_kernel[(t, triton.cdiv(r, block_r))](x, x.stride(0), a_stack, a_stack.stride(0), a_stack.stride(1),
                                                     token_slots, h, h.stride(0), k, r, BLOCK_R=block_r,
                                                     BLOCK_K=BLOCK_K, num_warps=4)
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b_stack: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """y [T, N] += h [T, R] @ b_stack[slot].T per token (in place; returned)."""
    b_stack = b_stack.contiguous()
    target = _rows(y)
    t, n = target.shape
    r = b_stack.shape[2]
    if t:
        _expand_kernel[(t, triton.cdiv(n, BLOCK_N))](target, target.stride(0), h, h.stride(0), b_stack,
                                                     b_stack.stride(0), b_stack.stride(1), token_slots, n, r,
                                                     BLOCK_N=BLOCK_N, BLOCK_R=triton.next_power_of_2(r),
                                                     num_warps=4)
    if target is not y:
        y.copy_(target)
    return y
