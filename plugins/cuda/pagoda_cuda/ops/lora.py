"""Batched LoRA shrink and expand over a batch that mixes adapters (slot per token, -1: base rows,
which add nothing), SGMV-style. Signatures and shapes: ``pagoda.lora.ops`` (the torch reference):
  shrink  h [P, T, R] = partial sums over P slices of K of x [T, K] @ a_stack[slot].T (float32)
          grid (tiles, R / BLOCK_R, P)
  expand  y [T, N] += (sum of h over P) @ b_stack[slot].T       grid (tiles, N / BLOCK_N)
The work list comes from the host (``pagoda.lora.ops.token_tiles``): the tokens sorted by slot, cut
into tiles of at most TILE_TOKENS tokens of one adapter each, so every program multiplies one
adapter's weights with no loop over adapters and no data-dependent control flow: a prefill chunk
of one sequence is a plain tiled GEMM, a decode batch of many adapters one small product per adapter
run. Zero-length tiles (a fixed grid for decode graphs) load and store nothing. A small batch (a
decode step) splits K over P programs so that the grid fills the device; the expand sums the P
partials as it reads them, so the split costs no extra launch and stays deterministic. Tokens of
base rows are in no tile: their h rows are never written nor read.
Products: bf16/fp16 operands on the matrix units with float32 accumulation in the shrink (the
products are exact), TF32 in the expand (its float32 input); IEEE float32 for float32 models and
plain float32 under the interpreter (which computes bf16 wrongly)."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from pagoda.lora.ops import TILE_TOKENS, token_tiles

from pagoda_cuda._triton import interpreting, sm_count

BLOCK_K = 64
BLOCK_N = 64
MAX_SPLIT = 8  # partials the expand sums per token


@triton.jit
def _tile(tiles_ptr, tiles_stride, order_ptr, BLOCK_T: tl.constexpr):
    """This program's tile: its tokens (masked beyond its length) and its adapter's slot."""
    tile = tl.program_id(0)
    start = tl.load(tiles_ptr + tile)
    length = tl.load(tiles_ptr + tiles_stride + tile)
    slot = tl.load(tiles_ptr + 2 * tiles_stride + tile)
    lanes = tl.arange(0, BLOCK_T)
    inside = lanes < length
    tokens = tl.load(order_ptr + start + lanes, mask=inside, other=0).to(tl.int64)
    return tokens, inside, slot.to(tl.int64)


@triton.jit
def _shrink_kernel(x_ptr, x_stride, a_ptr, a_slot_stride, a_row_stride, tiles_ptr, tiles_stride, order_ptr,
                   h_ptr, h_split_stride, h_stride, K_PER_SPLIT, K: tl.constexpr, R, NATIVE: tl.constexpr,
                   IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # K (a layer's input width) is a compile-time constant: a handful per model
    tokens, inside, slot = _tile(tiles_ptr, tiles_stride, order_ptr, BLOCK_T)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    k_begin = tl.program_id(2) * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    a_base = a_ptr + slot * a_slot_stride
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + tokens[:, None] * x_stride + cols[None, :],
                    mask=inside[:, None] & (cols[None, :] < k_end), other=0.0)
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
                   tiles_ptr, tiles_stride, order_ptr, N, R, SPLIT: tl.constexpr, IEEE: tl.constexpr,
                   PLAIN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    tokens, inside, slot = _tile(tiles_ptr, tiles_stride, order_ptr, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    h = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for p in tl.static_range(SPLIT):  # the shrink's partial sums over slices of K
        h += tl.load(h_ptr + p * h_split_stride + tokens[:, None] * h_stride + ranks[None, :],
                     mask=inside[:, None] & (ranks[None, :] < R), other=0.0)
    b = tl.load(b_ptr + slot * b_slot_stride + cols[None, :] * b_row_stride + ranks[:, None],
                mask=(cols[None, :] < N) & (ranks[:, None] < R), other=0.0).to(tl.float32)  # B.T [R, N]
    if IEEE:
        acc = tl.dot(h, b, input_precision="ieee")
    elif PLAIN:
        acc = tl.dot(h, b)
    else:
        acc = tl.dot(h, b, input_precision="tf32")
    mask = inside[:, None] & (cols[None, :] < N)
    out = y_ptr + tokens[:, None] * y_stride + cols[None, :]
    y = tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _rank_block(r: int) -> int:
    return max(16, triton.next_power_of_2(r))  # tl.dot needs 16 or more


def _split(device: torch.device, programs: int, k: int) -> tuple[int, int]:
    """(P, K per slice): slices of K so that ``programs`` x P fill the device (a decode step's few
    tiles), at most MAX_SPLIT; K per slice a multiple of BLOCK_K."""
    k_blocks = triton.cdiv(k, BLOCK_K)
    want = triton.cdiv(2 * sm_count(device), max(1, programs)) if device.type == "cuda" else 2
    per_slice = triton.cdiv(k_blocks, max(1, min(MAX_SPLIT, k_blocks, want))) * BLOCK_K
    return triton.cdiv(k, per_slice), per_slice


def _work_list(token_slots: torch.Tensor, token_order, tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine passes the order and tiles it built on the host; a direct call gets them here
    (one device-to-host read)."""
    if token_order is not None and tiles is not None:
        return token_order, tiles
    slots = token_slots.cpu().numpy()
    order = np.argsort(slots, kind="stable")
    return (torch.from_numpy(order).to(token_slots.device),
            torch.from_numpy(token_tiles(slots[order])).to(token_slots.device))


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, token_slots: torch.Tensor,
                token_order: torch.Tensor | None = None, tiles: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K], a_stack [S, R, K], token_slots [T] (-1: none) -> h [P, T, R] float32 partial sums."""
    x, a_stack = _rows(x), a_stack.contiguous()
    order, tiles = _work_list(token_slots, token_order, tiles)
    t, k = x.shape
    r = a_stack.shape[1]
    block_r = min(64, _rank_block(r))
    num_tiles = tiles.shape[1]
    split, per_slice = _split(x.device, num_tiles * triton.cdiv(r, block_r), k)
    h = torch.empty(split, t, r, dtype=torch.float32, device=x.device)
    if t and num_tiles:
        native = x.dtype == a_stack.dtype and x.dtype in (torch.bfloat16, torch.float16) and not interpreting()
        _shrink_kernel[(num_tiles, triton.cdiv(r, block_r), split)](
            x, x.stride(0), a_stack, a_stack.stride(0), a_stack.stride(1), tiles, tiles.stride(0), order, h,
            h.stride(0), h.stride(1), per_slice, k, r, NATIVE=native,
            IEEE=x.dtype == torch.float32 and not interpreting(), BLOCK_T=TILE_TOKENS, BLOCK_R=block_r,
            BLOCK_K=BLOCK_K, num_warps=4)
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b_stack: torch.Tensor, token_slots: torch.Tensor,
                token_order: torch.Tensor | None = None, tiles: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, N] += (sum of h [P, T, R] over P) @ b_stack[slot].T per token (in place; returned)."""
    b_stack = b_stack.contiguous()
    order, tiles = _work_list(token_slots, token_order, tiles)
    target = _rows(y)
    t, n = target.shape
    r = b_stack.shape[2]
    if t and tiles.shape[1]:
        h = h if h.stride(-1) == 1 else h.contiguous()
        grid = (tiles.shape[1], triton.cdiv(n, BLOCK_N))
        _expand_kernel[grid](target, target.stride(0), h, h.stride(0), h.stride(1), b_stack, b_stack.stride(0),
                             b_stack.stride(1), tiles, tiles.stride(0), order, n, r, SPLIT=h.shape[0],
                             IEEE=y.dtype == torch.float32 and not interpreting(), PLAIN=interpreting(),
                             BLOCK_T=TILE_TOKENS, BLOCK_N=BLOCK_N, BLOCK_R=_rank_block(r), num_warps=4)
    if target is not y:
        y.copy_(target)
    return y
