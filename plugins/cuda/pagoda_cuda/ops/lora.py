"""Batched LoRA shrink and expand over a batch that mixes adapters (slot per token, -1: base rows,
which add nothing). Signatures and shapes: ``pagoda.lora.ops`` (the torch reference):
  shrink  h [P, T, R] = partial sums over P slices of K of x [T, K] @ a_stack[slot].T (float32)
          grid (T / BLOCK_T, R / BLOCK_R, P)
  expand  y [T, N] += (sum of h over P) @ b_stack[slot].T       grid (T / BLOCK_T, N / BLOCK_N)
Tokens are visited in ``token_order`` (sorted by slot) when given, so a tile of BLOCK_T entries
holds few adapters: each program runs one tensor-core product per distinct adapter among its
tokens (the others masked to zero), so a prefill chunk of one sequence is one tiled GEMM (SGMV)
and a decode tile of a many-adapter batch loops over the few adapters it holds. A small batch
(a decode step) splits K over P programs so that the grid fills the device; the expand sums the
P partials as it reads them, so the split costs no extra launch and stays deterministic.
Products: bf16/fp16 operands on the matrix units with float32 accumulation in the shrink (the
products are exact), TF32 in the expand (its float32 input); IEEE float32 for float32 models and
plain float32 under the interpreter (which computes bf16 wrongly)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_cuda._triton import interpreting, sm_count

BLOCK_T = 16
BLOCK_K = 64
BLOCK_N = 64
NO_SLOT = 1 << 30
MAX_SPLIT = 8  # partials the expand sums per token


@triton.jit
def _next_slot(slots, remaining, NO_SLOT: tl.constexpr):
    """The smallest slot among the tokens still to do, and which tokens have it."""
    slot = tl.min(tl.where(remaining, slots, NO_SLOT), axis=0)
    return slot, remaining & (slots == slot)


@triton.jit
def _tile_tokens(order_ptr, slots_ptr, T, HAS_ORDER: tl.constexpr, BLOCK_T: tl.constexpr):
    """The tokens of this program's tile (through the slot order when given) and their slots."""
    pos = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    inside = pos < T
    if HAS_ORDER:
        tokens = tl.load(order_ptr + pos, mask=inside, other=0)
    else:
        tokens = pos
    slots = tl.load(slots_ptr + tokens, mask=inside, other=-1).to(tl.int32)
    return tokens.to(tl.int64), slots, inside


@triton.jit
def _shrink_kernel(x_ptr, x_stride, a_ptr, a_slot_stride, a_row_stride, slots_ptr, order_ptr, h_ptr,
                   h_split_stride, h_stride, T, K_PER_SPLIT, K: tl.constexpr, R, HAS_ORDER: tl.constexpr,
                   NATIVE: tl.constexpr, IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, NO_SLOT: tl.constexpr):
    # K (a layer's input width) is a compile-time constant: a handful per model
    tokens, slots, inside = _tile_tokens(order_ptr, slots_ptr, T, HAS_ORDER, BLOCK_T)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    k_begin = tl.program_id(2) * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    remaining = slots >= 0
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    while tl.max(remaining.to(tl.int32), axis=0) > 0:
        slot, chosen = _next_slot(slots, remaining, NO_SLOT)
        remaining = remaining & ~chosen
        a_base = a_ptr + slot.to(tl.int64) * a_slot_stride
        for k0 in range(k_begin, k_end, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + tokens[:, None] * x_stride + cols[None, :],
                        mask=chosen[:, None] & (cols[None, :] < k_end), other=0.0)
            a = tl.load(a_base + rows[None, :] * a_row_stride + cols[:, None],  # A.T tile [BLOCK_K, BLOCK_R]
                        mask=(rows[None, :] < R) & (cols[:, None] < k_end), other=0.0)
            if NATIVE:  # bf16 / fp16 operands: exact products, float32 sums
                acc += tl.dot(x, a)
            elif IEEE:
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
    out = h_ptr + tl.program_id(2).to(tl.int64) * h_split_stride + tokens[:, None] * h_stride + rows[None, :]
    tl.store(out, acc, mask=inside[:, None] & (rows[None, :] < R))


@triton.jit
def _expand_kernel(y_ptr, y_stride, h_ptr, h_split_stride, h_stride, b_ptr, b_slot_stride, b_row_stride,
                   slots_ptr, order_ptr, T, N, R, SPLIT: tl.constexpr, HAS_ORDER: tl.constexpr,
                   IEEE: tl.constexpr, PLAIN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, NO_SLOT: tl.constexpr):
    tokens, slots, inside = _tile_tokens(order_ptr, slots_ptr, T, HAS_ORDER, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    remaining = slots >= 0
    any_rows = tl.max(remaining.to(tl.int32), axis=0) > 0
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    while tl.max(remaining.to(tl.int32), axis=0) > 0:
        slot, chosen = _next_slot(slots, remaining, NO_SLOT)
        remaining = remaining & ~chosen
        h = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for p in tl.static_range(SPLIT):  # the shrink's partial sums over slices of K
            h += tl.load(h_ptr + p * h_split_stride + tokens[:, None] * h_stride + ranks[None, :],
                         mask=chosen[:, None] & (ranks[None, :] < R), other=0.0)
        b = tl.load(b_ptr + slot.to(tl.int64) * b_slot_stride + cols[None, :] * b_row_stride + ranks[:, None],
                    mask=(cols[None, :] < N) & (ranks[:, None] < R), other=0.0).to(tl.float32)  # B.T [R, N]
        if IEEE:
            acc += tl.dot(h, b, input_precision="ieee")
        elif PLAIN:
            acc += tl.dot(h, b)
        else:
            acc += tl.dot(h, b, input_precision="tf32")
    if any_rows:
        mask = inside[:, None] & (slots[:, None] >= 0) & (cols[None, :] < N)
        out = y_ptr + tokens[:, None] * y_stride + cols[None, :]
        y = tl.load(out, mask=mask, other=0.0).to(tl.float32)
        tl.store(out, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _rank_block(r: int) -> int:
    return max(16, triton.next_power_of_2(r))  # tl.dot needs 16 or more


def _split(device: torch.device, tiles: int, k: int) -> tuple[int, int]:
    """(P, K per slice): slices of K so that tiles x P programs fill the device (a decode step's
    few token tiles), at most MAX_SPLIT; K per slice a multiple of BLOCK_K."""
    k_blocks = triton.cdiv(k, BLOCK_K)
    want = triton.cdiv(2 * sm_count(device), max(1, tiles)) if device.type == "cuda" else 2
    per_slice = triton.cdiv(k_blocks, max(1, min(MAX_SPLIT, k_blocks, want))) * BLOCK_K
    return triton.cdiv(k, per_slice), per_slice


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, token_slots: torch.Tensor,
                token_order: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K], a_stack [S, R, K], token_slots [T] (-1: none) -> h [P, T, R] float32 partial sums."""
    x, a_stack = _rows(x), a_stack.contiguous()
    t, k = x.shape
    r = a_stack.shape[1]
    block_r = min(64, _rank_block(r))
    tiles = triton.cdiv(t, BLOCK_T) * triton.cdiv(r, block_r)
    split, per_slice = _split(x.device, tiles, k)
    h = torch.empty(split, t, r, dtype=torch.float32, device=x.device)
    if t:
        native = x.dtype == a_stack.dtype and x.dtype in (torch.bfloat16, torch.float16) and not interpreting()
        order = token_order if token_order is not None else token_slots
        _shrink_kernel[(triton.cdiv(t, BLOCK_T), triton.cdiv(r, block_r), split)](
            x, x.stride(0), a_stack, a_stack.stride(0), a_stack.stride(1), token_slots, order, h, h.stride(0),
            h.stride(1), t, per_slice, k, r, HAS_ORDER=token_order is not None, NATIVE=native,
            IEEE=x.dtype == torch.float32 and not interpreting(), BLOCK_T=BLOCK_T, BLOCK_R=block_r,
            BLOCK_K=BLOCK_K, NO_SLOT=NO_SLOT, num_warps=4)
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b_stack: torch.Tensor, token_slots: torch.Tensor,
                token_order: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, N] += (sum of h [P, T, R] over P) @ b_stack[slot].T per token (in place; returned)."""
    b_stack = b_stack.contiguous()
    target = _rows(y)
    t, n = target.shape
    r = b_stack.shape[2]
    if t:
        h = h if h.stride(-1) == 1 else h.contiguous()
        order = token_order if token_order is not None else token_slots
        grid = (triton.cdiv(t, BLOCK_T), triton.cdiv(n, BLOCK_N))
        _expand_kernel[grid](target, target.stride(0), h, h.stride(0), h.stride(1), b_stack, b_stack.stride(0),
                             b_stack.stride(1), token_slots, order, t, n, r, SPLIT=h.shape[0],
                             HAS_ORDER=token_order is not None, IEEE=y.dtype == torch.float32 and not interpreting(),
                             PLAIN=interpreting(), BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, BLOCK_R=_rank_block(r),
                             NO_SLOT=NO_SLOT, num_warps=4)
    if target is not y:
        y.copy_(target)
    return y
