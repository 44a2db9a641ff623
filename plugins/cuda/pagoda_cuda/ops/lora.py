"""Batched LoRA shrink and expand over a batch that mixes adapters (slot per token, -1: base rows,
which add nothing), SGMV-style. Signatures and shapes: ``pagoda.lora.ops`` (the torch reference):
  shrink  h [P, T, R] = partial sums over P slices of K of x [T, K] @ a_stack[slot].T (float32)
          grid (tiles, R / BLOCK_R, P)
  expand  y [T, N] += (sum of h over P) @ b_stack[slot].T       grid (tiles, N / BLOCK_N)
  fused   y [T, N] += (x @ a_stack[slot].T) @ b_stack[slot].T   grid (column groups, tiles): one launch
The fused kernel (what the layers call) gives each program one tile and one group of output columns:
it computes the tile's h = x_tile @ A_slot.T over the whole K in registers, then adds h @ B_slot.T
over its columns, BLOCK_N at a time, into y. Every column group of a tile recomputes that tile's h
(x_tile and A_slot are read again, from L2): the group width is chosen from the number of tiles
(``fused_config``) so that the grid fills the device with as little recomputation as it needs. Of a
fused layer (q/k/v, gate/up) whose B is block-diagonal over its pieces, a column group lies in one
piece and computes only that piece's rank columns of h (a third of the shrink for q/k/v).
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

import os

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
def _tile(tiles_ptr, tiles_stride, order_ptr, tile, BLOCK_T: tl.constexpr):
    """Tile ``tile``: its tokens (masked beyond its length), its length and its adapter's slot."""
    start = tl.load(tiles_ptr + tile)
    length = tl.load(tiles_ptr + tiles_stride + tile)
    slot = tl.load(tiles_ptr + 2 * tiles_stride + tile)
    lanes = tl.arange(0, BLOCK_T)
    inside = lanes < length
    tokens = tl.load(order_ptr + start + lanes, mask=inside, other=0).to(tl.int64)
    return tokens, inside, length, slot.to(tl.int64)


@triton.jit
def _shrink_dot(x_ptr, x_stride, tokens, inside, a_base, a_row_stride, ranks, rank_ok, k_begin, k_stop, k_end,
                NATIVE: tl.constexpr, IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """x[tokens, k_begin:k_end] @ A[ranks, k_begin:k_end].T -> [BLOCK_T, BLOCK_R] float32 (the loop runs to
    k_stop: k_end, or 0 for an empty tile, which then loads nothing)."""
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_begin, k_stop, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + tokens[:, None] * x_stride + cols[None, :],
                    mask=inside[:, None] & (cols[None, :] < k_end), other=0.0)
        a = tl.load(a_base + ranks[None, :] * a_row_stride + cols[:, None],  # A.T tile [BLOCK_K, BLOCK_R]
                    mask=rank_ok[None, :] & (cols[:, None] < k_end), other=0.0)
        if NATIVE:  # bf16 / fp16 operands: exact products, float32 sums
            acc += tl.dot(x, a)
        elif IEEE:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
    return acc


@triton.jit
def _shrink_kernel(x_ptr, x_stride, a_ptr, a_slot_stride, a_row_stride, tiles_ptr, tiles_stride, order_ptr,
                   h_ptr, h_split_stride, h_stride, K_PER_SPLIT, K: tl.constexpr, R, NATIVE: tl.constexpr,
                   IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # K (a layer's input width) is a compile-time constant: a handful per model
    tokens, inside, _, slot = _tile(tiles_ptr, tiles_stride, order_ptr, tl.program_id(0), BLOCK_T)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    k_begin = tl.program_id(2) * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    acc = _shrink_dot(x_ptr, x_stride, tokens, inside, a_ptr + slot * a_slot_stride, a_row_stride, rows, rows < R,
                      k_begin, k_end, k_end, NATIVE, IEEE, BLOCK_T, BLOCK_R, BLOCK_K)
    out = h_ptr + tl.program_id(2).to(tl.int64) * h_split_stride + tokens[:, None] * h_stride + rows[None, :]
    tl.store(out, acc, mask=inside[:, None] & (rows[None, :] < R))


@triton.jit
def _expand_kernel(y_ptr, y_stride, h_ptr, h_split_stride, h_stride, b_ptr, b_slot_stride, b_row_stride,
                   tiles_ptr, tiles_stride, order_ptr, N, R, SPLIT: tl.constexpr, IEEE: tl.constexpr,
                   PLAIN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    tokens, inside, _, slot = _tile(tiles_ptr, tiles_stride, order_ptr, tl.program_id(0), BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    h = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for p in tl.static_range(SPLIT):  # the shrink's partial sums over slices of K
        h += tl.load(h_ptr + p * h_split_stride + tokens[:, None] * h_stride + ranks[None, :],
                     mask=inside[:, None] & (ranks[None, :] < R), other=0.0)
    b = tl.load(b_ptr + slot * b_slot_stride + cols[None, :] * b_row_stride + ranks[:, None],
                mask=(cols[None, :] < N) & (ranks[:, None] < R), other=0.0).to(tl.float32)  # B.T [R, N]
    acc = _expand_dot(h, b, IEEE, PLAIN)
    mask = inside[:, None] & (cols[None, :] < N)
    out = y_ptr + tokens[:, None] * y_stride + cols[None, :]
    y = tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _piece(group, P0, P1, P2, GROUP_N):
    """Column group ``group`` of a layer of up to three pieces (widths P0, P1, P2), each cut into groups
    of GROUP_N columns numbered piece by piece: (its piece's index, its group within the piece, the
    piece's first column, the piece's width)."""
    c0 = tl.cdiv(P0, GROUP_N)
    c1 = tl.cdiv(P1, GROUP_N)
    second = group >= c0
    third = group >= c0 + c1
    chunk = group - tl.where(second, c0, 0) - tl.where(third, c1, 0)
    offset = tl.where(second, P0, 0) + tl.where(third, P1, 0)
    size = tl.where(third, P2, tl.where(second, P1, P0))
    return second.to(tl.int32) + third.to(tl.int32), chunk, offset, size


@triton.jit
def _fused_kernel(x_ptr, x_stride, y_ptr, y_stride, a_ptr, a_slot_stride, a_row_stride, b_ptr, b_slot_stride,
                  b_row_stride, tiles_ptr, tiles_stride, order_ptr, K, P0, P1, P2, RANK_W, GROUP_N,
                  NATIVE: tl.constexpr, IEEE: tl.constexpr, PLAIN: tl.constexpr, ALIGNED: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (column group, tile). The output columns are up to three pieces of widths P0, P1, P2
    (P1 = P2 = 0: one piece), piece i using rank columns i*RANK_W.. of A and B; each piece is cut
    into groups of GROUP_N columns (a multiple of BLOCK_N), numbered piece by piece.
    (Launched plainly, not with programmatic dependent launch: starting the shrink while the base GEMM finished
    made a 16-adapter batch 9% slower on an H200, docs/benchmarks.md, nineteenth session.)"""
    group = tl.program_id(0)
    tokens, inside, length, slot = _tile(tiles_ptr, tiles_stride, order_ptr, tl.program_id(1), BLOCK_T)
    piece, chunk, offset, size = _piece(group, P0, P1, P2, GROUP_N)
    col_begin = offset + chunk * GROUP_N
    col_end = offset + tl.minimum((chunk + 1) * GROUP_N, size)
    if ALIGNED:  # piece widths and GROUP_N multiples of 8: whole 16-byte stores
        col_begin = tl.multiple_of(col_begin, 8)
    lanes_r = tl.arange(0, BLOCK_R)
    ranks = piece * RANK_W + lanes_r
    rank_ok = lanes_r < RANK_W
    # an empty tile (padding of a decode graph's fixed grid) runs neither loop and loads nothing
    live = length > 0
    k_stop = tl.where(live, K, 0)
    n_stop = tl.where(live, col_end, col_begin)
    b_base = b_ptr + slot * b_slot_stride
    # the first BLOCK_N columns' B and y are loaded before the shrink, so that their latency overlaps it
    # (at decode sizes a group is often one block of columns)
    cols = col_begin + tl.arange(0, BLOCK_N)
    col_ok = (cols < col_end) & live
    b_first = tl.load(b_base + cols[None, :] * b_row_stride + ranks[:, None],  # B.T [BLOCK_R, BLOCK_N]
                      mask=col_ok[None, :] & rank_ok[:, None], other=0.0)
    mask_first = inside[:, None] & col_ok[None, :]
    y_at = y_ptr + tokens[:, None] * y_stride + cols[None, :]
    y_first = tl.load(y_at, mask=mask_first, other=0.0)
    # h = x_tile @ A_slot.T (this piece's rank columns), over the whole K
    h = _shrink_dot(x_ptr, x_stride, tokens, inside, a_ptr + slot * a_slot_stride, a_row_stride, ranks, rank_ok,
                    0, k_stop, K, NATIVE, IEEE, BLOCK_T, BLOCK_R, BLOCK_K)
    # y[:, group's columns] += h @ B_slot[columns, ranks].T, BLOCK_N columns at a time
    d = _expand_dot(h, b_first.to(tl.float32), IEEE, PLAIN)
    tl.store(y_at, (y_first.to(tl.float32) + d).to(y_ptr.dtype.element_ty), mask=mask_first)
    for n0 in range(col_begin + BLOCK_N, n_stop, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < col_end
        b = tl.load(b_base + cols[None, :] * b_row_stride + ranks[:, None],
                    mask=col_ok[None, :] & rank_ok[:, None], other=0.0).to(tl.float32)
        d = _expand_dot(h, b, IEEE, PLAIN)
        mask = inside[:, None] & col_ok[None, :]
        out = y_ptr + tokens[:, None] * y_stride + cols[None, :]
        y = tl.load(out, mask=mask, other=0.0).to(tl.float32)
        tl.store(out, (y + d).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expand_dot(h, b, IEEE: tl.constexpr, PLAIN: tl.constexpr):
    """h [BLOCK_T, BLOCK_R] float32 @ b [BLOCK_R, BLOCK_N] float32: TF32 on a GPU (IEEE for float32
    models), plain float32 in the interpreter."""
    if IEEE:
        return tl.dot(h, b, input_precision="ieee")
    elif PLAIN:
        return tl.dot(h, b)
    else:
        return tl.dot(h, b, input_precision="tf32")


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


DECODE_TOKENS = 256  # up to this many tokens a batch is decode-sized (the graphs' buckets)
# (BLOCK_N, BLOCK_K, programs per multiprocessor the column groups aim at, num_warps) of the fused kernel,
# the fastest over Qwen3-0.6B's layers in kernel_bench's sweep on an H200 (docs/benchmarks.md)
FUSED_DECODE = (128, 128, 1, 4)
FUSED_PREFILL = (128, 128, 2, 4)


def fused_config(num_tokens: int) -> tuple:
    return FUSED_DECODE if num_tokens <= DECODE_TOKENS else FUSED_PREFILL


def _pieces(n: int, r: int, piece_sizes) -> tuple[tuple[int, int, int], int]:
    """The kernel's (P0, P1, P2) and rank columns per piece: the layer's pieces when B is block-diagonal
    over at most three of them, else one piece of all N columns and all R ranks."""
    if piece_sizes and 1 < len(piece_sizes) <= 3 and sum(piece_sizes) == n and r % len(piece_sizes) == 0:
        return tuple(piece_sizes) + (0,) * (3 - len(piece_sizes)), r // len(piece_sizes)
    return (n, 0, 0), r


def column_groups(pieces, num_tiles: int, block_n: int, programs: int) -> tuple[int, int]:
    """(GROUP_N, number of groups): each piece cut into groups of GROUP_N columns, so that the tiles x
    groups come near ``programs`` (each group recomputes its tile's h: no more groups than that)."""
    per_tile = max(1, triton.cdiv(programs, max(1, num_tiles)))
    blocks = sum(triton.cdiv(p, block_n) for p in pieces)
    width = max(1, blocks // per_tile) * block_n
    return width, sum(triton.cdiv(p, width) for p in pieces)


def lora_fused(x: torch.Tensor, y: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
               token_slots: torch.Tensor, token_order: torch.Tensor | None = None, tiles: torch.Tensor | None = None,
               piece_sizes: tuple[int, ...] | None = None, config: tuple | None = None
               ) -> torch.Tensor:
    """y [T, N] += (x [T, K] @ a_stack[slot].T) @ b_stack[slot].T per token, one launch (in place; returned).
    ``config``: (BLOCK_N, BLOCK_K, programs per SM, num_warps), by default ``fused_config(T)``."""
    order, tiles = _work_list(token_slots, token_order, tiles)
    t, k = x.shape
    x, a_stack, b_stack = _rows(x), a_stack.contiguous(), b_stack.contiguous()
    target = _rows(y)
    n, r = target.shape[1], a_stack.shape[1]
    num_tiles = tiles.shape[1]
    if t and num_tiles:
        block_n, block_k, per_sm, warps = config or fused_config(t)
        pieces, rank_w = _pieces(n, r, piece_sizes)
        width, groups = column_groups(pieces, num_tiles, block_n, max(1, int(per_sm * sm_count(x.device))))
        native = x.dtype == a_stack.dtype and x.dtype in (torch.bfloat16, torch.float16) and not interpreting()
        _fused_kernel[(groups, num_tiles)](
            x, x.stride(0), target, target.stride(0), a_stack, a_stack.stride(0), a_stack.stride(1), b_stack,
            b_stack.stride(0), b_stack.stride(1), tiles, tiles.stride(0), order, k, *pieces, rank_w, width,
            NATIVE=native, IEEE=y.dtype == torch.float32 and not interpreting(), PLAIN=interpreting(),
            ALIGNED=all(p % 8 == 0 for p in pieces) and not interpreting(), BLOCK_T=TILE_TOKENS,
            BLOCK_R=_rank_block(rank_w), BLOCK_K=block_k, BLOCK_N=block_n, num_warps=warps)
    if target is not y:
        y.copy_(target)
    return y


@triton.jit
def _expand_stacked_kernel(out_ptr, out_stride, N, b_ptr, b_slot_stride, b_row_stride, tiles_ptr, tiles_stride,
                           order_ptr, SLOT_W, P0, P1, P2, RANK_W, NATIVE: tl.constexpr, PLAIN: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (column block, tile): out[tokens, cols] += h @ B_slot[cols, ranks].T, where h is the tile's
    shrink as the base GEMM over the stacked weight wrote it: out[tokens, N + slot*SLOT_W + ranks]. A column
    block lies in one piece (blocks are counted piece by piece) and uses that piece's RANK_W rank columns."""
    block = tl.program_id(0)
    tokens, inside, length, slot = _tile(tiles_ptr, tiles_stride, order_ptr, tl.program_id(1), BLOCK_T)
    piece, chunk, offset, size = _piece(block, P0, P1, P2, BLOCK_N)
    lanes_n = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    live = length > 0
    col_ok = (lanes_n < size) & live
    cols = offset + lanes_n
    lanes_r = tl.arange(0, BLOCK_R)
    ranks = piece * RANK_W + lanes_r
    rank_ok = (lanes_r < RANK_W) & live
    rows = out_ptr + tokens[:, None] * out_stride
    h = tl.load(rows + N + slot * SLOT_W + ranks[None, :], mask=inside[:, None] & rank_ok[None, :], other=0.0)
    b = tl.load(b_ptr + slot * b_slot_stride + cols[None, :] * b_row_stride + ranks[:, None],  # B.T [R, BLOCK_N]
                mask=col_ok[None, :] & rank_ok[:, None], other=0.0)
    if NATIVE:  # bf16 / fp16: exact products, float32 sums
        d = tl.dot(h, b)
    else:
        d = _expand_dot(h.to(tl.float32), b.to(tl.float32), not PLAIN, PLAIN)
    mask = inside[:, None] & col_ok[None, :]
    y = tl.load(rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(rows + cols[None, :], (y + d).to(out_ptr.dtype.element_ty), mask=mask)


STACKED_BLOCK_N = 128


def lora_expand_stacked(out: torch.Tensor, n: int, b_stack: torch.Tensor, token_slots: torch.Tensor,
                        token_order: torch.Tensor | None = None, tiles: torch.Tensor | None = None,
                        piece_sizes: tuple[int, ...] | None = None) -> torch.Tensor:
    """The expand of a layer whose base GEMM also computed every slot's shrink (``pagoda.lora.ops``):
    out [T, n + S*R] holds the base output, then slot s's h in columns n + s*R..; each adapted token's
    h_slot @ b_stack[slot].T is added into ``out[:, :n]`` in place (base tokens keep the base output),
    and that view is returned. One launch, program (column block, tile); a column block lies in one
    piece of a fused layer and reads only that piece's rank columns."""
    t = out.shape[0]
    s, _, r = b_stack.shape
    if out.stride(-1) != 1 or out.shape[1] != n + s * r:
        raise ValueError(f"lora_expand_stacked: out {tuple(out.shape)} is not [T, {n} + {s} x {r}] with unit stride")
    order, tiles = _work_list(token_slots, token_order, tiles)
    pieces, rank_w = _pieces(n, r, piece_sizes)
    num_tiles = tiles.shape[1]
    if t and num_tiles:
        blocks = sum(triton.cdiv(p, STACKED_BLOCK_N) for p in pieces)
        native = out.dtype == b_stack.dtype and out.dtype in (torch.bfloat16, torch.float16) and not interpreting()
        _expand_stacked_kernel[(blocks, num_tiles)](
            out, out.stride(0), n, b_stack, b_stack.stride(0), b_stack.stride(1), tiles, tiles.stride(0), order, r,
            *pieces, rank_w, NATIVE=native, PLAIN=interpreting(), BLOCK_T=TILE_TOKENS, BLOCK_R=_rank_block(rank_w),
            BLOCK_N=STACKED_BLOCK_N, num_warps=4)
    return out[:, :n]


# the largest step (tokens) for which an adapted layer runs its stacked GEMM and this expand rather than
# the plain GEMM and lora_fused: above it, the shrink of every slot in the GEMM costs more than it saves
# (PAGODA_CUDA_LORA_STACKED_TOKENS, docs/cuda.md; 0: lora_fused at every size). 256, measured on an H200
# (twenty-first session, docs/benchmarks.md): Qwen3-0.6B, a batch of 64 with rank-16 adapters on every
# projection, 16 adapters cost 18.6-20.0% of the base's output tok/s against 35.3% through lora_fused, 1 and 4
# adapters 16.5% against 29-31%; per projection the stacked GEMM costs 1-7% over the plain one at 8-256 tokens
lora_expand_stacked.max_tokens = int(os.environ.get("PAGODA_CUDA_LORA_STACKED_TOKENS", 256))
