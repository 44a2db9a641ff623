"""Batched LoRA shrink and expand over a batch that mixes adapters (slot per token, -1: base rows,
which add nothing). Signatures and shapes: ``pagoda.lora.ops`` (the torch reference):
  shrink  h [T, R] = x [T, K] @ a_stack[slot].T   (float32 out)      grid (T / BLOCK_T, R / BLOCK_R)
  expand  y [T, N] += h [T, R] @ b_stack[slot].T                      grid (T / BLOCK_T, N / BLOCK_N)
Each program takes a tile of BLOCK_T consecutive tokens and runs one tensor-core product per
distinct adapter among them (the tokens of other adapters masked to zero), so a prefill chunk of
one sequence (one adapter) is one tiled GEMM (SGMV-like) and a decode batch of many adapters
loops over the few adapters of its tile. Arithmetic is float32 (loads are upcast first; products
in IEEE float32, not TF32: the ranks are small, so the update costs little either way)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16
BLOCK_K = 64
BLOCK_N = 64
NO_SLOT = 1 << 30


@triton.jit
def _next_slot(slots, remaining, NO_SLOT: tl.constexpr):
    """The smallest slot among the tokens still to do, and which tokens have it."""
    slot = tl.min(tl.where(remaining, slots, NO_SLOT), axis=0)
    return slot, remaining & (slots == slot)


@triton.jit
def _shrink_kernel(x_ptr, x_stride, a_ptr, a_slot_stride, a_row_stride, slots_ptr, h_ptr, h_stride, T,
                   K: tl.constexpr, R, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   NO_SLOT: tl.constexpr):
    # K (a layer's input width) is a compile-time constant: a handful per model
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slots = tl.load(slots_ptr + tokens, mask=tokens < T, other=-1).to(tl.int32)
    remaining = slots >= 0
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    while tl.max(remaining.to(tl.int32), axis=0) > 0:
        slot, chosen = _next_slot(slots, remaining, NO_SLOT)
        remaining = remaining & ~chosen
        a_base = a_ptr + slot.to(tl.int64) * a_slot_stride
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * x_stride + cols[None, :],
                        mask=chosen[:, None] & (cols[None, :] < K), other=0.0).to(tl.float32)
            a = tl.load(a_base + rows[None, :] * a_row_stride + cols[:, None],  # A.T tile [BLOCK_K, BLOCK_R]
                        mask=(rows[None, :] < R) & (cols[:, None] < K), other=0.0).to(tl.float32)
            acc += tl.dot(x, a, input_precision="ieee")
    tl.store(h_ptr + tokens.to(tl.int64)[:, None] * h_stride + rows[None, :], acc,
             mask=(tokens[:, None] < T) & (rows[None, :] < R))


@triton.jit
def _expand_kernel(y_ptr, y_stride, h_ptr, h_stride, b_ptr, b_slot_stride, b_row_stride, slots_ptr, T, N, R,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, NO_SLOT: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    slots = tl.load(slots_ptr + tokens, mask=tokens < T, other=-1).to(tl.int32)
    remaining = slots >= 0
    any_rows = tl.max(remaining.to(tl.int32), axis=0) > 0
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    while tl.max(remaining.to(tl.int32), axis=0) > 0:
        slot, chosen = _next_slot(slots, remaining, NO_SLOT)
        remaining = remaining & ~chosen
        h = tl.load(h_ptr + tokens.to(tl.int64)[:, None] * h_stride + ranks[None, :],
                    mask=chosen[:, None] & (ranks[None, :] < R), other=0.0)
        b = tl.load(b_ptr + slot.to(tl.int64) * b_slot_stride + cols[None, :] * b_row_stride + ranks[:, None],
                    mask=(cols[None, :] < N) & (ranks[:, None] < R), other=0.0).to(tl.float32)  # B.T [R, N]
        acc += tl.dot(h, b, input_precision="ieee")
    if any_rows:
        mask = (slots[:, None] >= 0) & (cols[None, :] < N)
        out = y_ptr + tokens.to(tl.int64)[:, None] * y_stride + cols[None, :]
        y = tl.load(out, mask=mask, other=0.0).to(tl.float32)
        tl.store(out, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _rank_block(r: int) -> int:
    return max(16, triton.next_power_of_2(r))  # tl.dot needs 16 or more


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a_stack [S, R, K], token_slots [T] (-1: none) -> h [T, R] float32."""
    x, a_stack = _rows(x), a_stack.contiguous()
    t, k = x.shape
    r = a_stack.shape[1]
    h = torch.empty(t, r, dtype=torch.float32, device=x.device)
    if t:
        block_r = min(64, _rank_block(r))
        grid = (triton.cdiv(t, BLOCK_T), triton.cdiv(r, block_r))
        _shrink_kernel[grid](x, x.stride(0), a_stack, a_stack.stride(0), a_stack.stride(1), token_slots, h,
                             h.stride(0), t, k, r, BLOCK_T=BLOCK_T, BLOCK_R=block_r, BLOCK_K=BLOCK_K,
                             NO_SLOT=NO_SLOT, num_warps=4)
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b_stack: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """y [T, N] += h [T, R] @ b_stack[slot].T per token (in place; returned)."""
    b_stack = b_stack.contiguous()
    target = _rows(y)
    t, n = target.shape
    r = b_stack.shape[2]
    if t:
        grid = (triton.cdiv(t, BLOCK_T), triton.cdiv(n, BLOCK_N))
        _expand_kernel[grid](target, target.stride(0), h, h.stride(0), b_stack, b_stack.stride(0),
                             b_stack.stride(1), token_slots, t, n, r, BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N,
                             BLOCK_R=_rank_block(r), NO_SLOT=NO_SLOT, num_warps=4)
    if target is not y:
        y.copy_(target)
    return y
