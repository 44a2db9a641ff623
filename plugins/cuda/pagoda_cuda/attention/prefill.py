"""Paged attention for prefill chunks: causal within the chunk, full over the cached prefix.

A chunk of ``q_len`` new tokens of a sequence whose cache holds ``seq_len`` tokens
(its own K/V already stored) starts at position ``ctx = seq_len - q_len``; query ``i``
sees keys ``0 .. ctx + i`` (and, with a sliding window, only the last ``window`` of them).
One program per (tile of BLOCK_M query tokens of one sequence, query head); the tiles are
listed on the host (``tile_map``: sequence index, first query token of the tile).
Key tiles that every row of the query tile sees whole (before its first query, inside every
row's window) skip the masking (``key_tile`` with MASKED=False); only the diagonal band and
window-cut tiles pay for it, as in the classic causal flash-attention kernels. Attention
sinks (per-head logits, GPT-OSS) join each row's denominator at the normalisation.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from pagoda.kernels.host_upload import upload

from pagoda_cuda._triton import interpreting, next_pow2, to_f16
from pagoda_cuda.attention.key_tile import key_tile


@triton.jit
def _prefill_kernel(q_ptr, stride_qt, stride_qh, k_cache, v_cache, stride_cb, stride_cs, stride_ch,
                    stride_vb, stride_vs, stride_vh, tables_ptr, stride_tb, stride_tn, seq_lens_ptr, qsl_ptr,
                    tile_map_ptr, out_ptr, stride_ot, stride_oh, scale, soft_cap, window, k_scale_ptr, v_scale_ptr,
                    qr_ptr, stride_qrt, stride_qrh, kr_cache, stride_rb, stride_rs, sinks_ptr,
                    GROUP: tl.constexpr, HEAD: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_V: tl.constexpr,
                    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, USE_WINDOW: tl.constexpr,
                    USE_CAP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, HAS_SCALE: tl.constexpr,
                    ROPE: tl.constexpr, BLOCK_R: tl.constexpr, DOT_F16: tl.constexpr, HAS_SINKS: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    seq = tl.load(tile_map_ptr + 2 * tile)
    m0 = tl.load(tile_map_ptr + 2 * tile + 1)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if m0 >= q_len:  # a padding tile of a captured batch's fixed map (pagoda.engine.mixed_graphs)
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    m = m0 + tl.arange(0, BLOCK_M)
    mmask = m < q_len
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD
    rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + h * stride_qh + rows[:, None] * stride_qt + d[None, :], mask=mmask[:, None] & dmask[None, :],
                other=0.0)
    r = tl.arange(0, BLOCK_R)
    rmask = r < ROPE
    qr = q  # placeholder without a rotary part
    if ROPE:
        qr = tl.load(qr_ptr + h * stride_qrh + rows[:, None] * stride_qrt + r[None, :],
                     mask=mmask[:, None] & rmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        qr = qr.to(tl.float32)
    elif DOT_F16:  # an fp8 cache widens to fp16 faster than to bf16: fp16 dots (queries
        # clamped to fp16's range; float32 accumulation), as in the decode kernel
        q = to_f16(q)
        qr = to_f16(qr)
    qpos = ctx + m  # absolute position of each query

    hi = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx + m0 - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    v_scale = 1.0
    if HAS_SCALE:  # an fp8 cache holds k / k_scale and v / v_scale: scale the scores and the output
        scale = scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    dv = tl.arange(0, BLOCK_DV)
    dvmask = dv < HEAD_V
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    table_row = tables_ptr + seq.to(tl.int64) * stride_tb
    k_base = k_cache + kvh.to(tl.int64) * stride_ch
    v_base = v_cache + kvh.to(tl.int64) * stride_vh
    # keys [u_lo, u_hi) are seen whole by every row: u_hi ends the last tile whose keys all lie
    # at or before the first query's own position ctx + m0; with a window, u_lo starts the first
    # tile at or after hi - window (the last row's window). Masked: [lo, u_lo) and [u_hi, hi).
    u_hi = lo + (tl.maximum(ctx + m0 + 1 - lo, 0) // BLOCK_N) * BLOCK_N
    u_lo = lo
    if USE_WINDOW:
        u_lo = lo + (tl.maximum(hi - window - lo, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        u_lo = tl.minimum(u_lo, u_hi)
        for n0 in range(lo, u_lo, BLOCK_N):
            acc, m_i, l_i = key_tile(acc, m_i, l_i, q, qr, n0, hi, qpos, window, table_row, stride_tn, k_base,
                                      v_base, stride_cb, stride_cs, stride_vb, stride_vs, kr_cache, stride_rb,
                                      stride_rs, d, dmask, dv, dvmask, r, rmask, scale, soft_cap,
                                      BLOCK_N, PAGE, True, USE_WINDOW, USE_CAP, UPCAST, IEEE, ROPE)
    for n0 in range(u_lo, u_hi, BLOCK_N):
        acc, m_i, l_i = key_tile(acc, m_i, l_i, q, qr, n0, hi, qpos, window, table_row, stride_tn, k_base, v_base,
                                  stride_cb, stride_cs, stride_vb, stride_vs, kr_cache, stride_rb, stride_rs, d, dmask,
                                  dv, dvmask, r, rmask, scale, soft_cap, BLOCK_N, PAGE, False,
                                  USE_WINDOW, USE_CAP, UPCAST, IEEE, ROPE)
    for n0 in range(u_hi, hi, BLOCK_N):
        acc, m_i, l_i = key_tile(acc, m_i, l_i, q, qr, n0, hi, qpos, window, table_row, stride_tn, k_base, v_base,
                                  stride_cb, stride_cs, stride_vb, stride_vs, kr_cache, stride_rb, stride_rs, d, dmask,
                                  dv, dvmask, r, rmask, scale, soft_cap, BLOCK_N, PAGE, True,
                                  USE_WINDOW, USE_CAP, UPCAST, IEEE, ROPE)
    if HAS_SINKS:  # exp(sink) joins the denominator (log2 domain, like m_i)
        l_i = l_i + tl.exp2(tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634 - m_i)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc * (v_scale / l_i)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & dvmask[None, :])


def prefill_config(head: int, head_v: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the K and V widths (``head_v``: V's when it
    differs, as for MLA's expanded keys)."""
    head_v = head if head_v is None else head_v
    if next_pow2(max(head, head_v)) >= 256:
        if head_v <= 128:
            # MLA's 128 + 64-wide keys (two dots) and 128-wide values, H200, 16 x 512 tokens x 128
            # heads (kernel_bench): 870 us against 990-1,023 us with 128-row tiles (8 warps)
            return 64, 64, 4, 2
        return 64, 32, 8, 2
    # H200, 16 x 512-token prompts (kernel_bench): Phi-3 (32 heads x 96) 208 -> 190 us against
    # (64, 64, 4, 2), Qwen3 (16/8 heads x 128) 98.5 -> 97.9 us
    return 64, 32, 4, 2


def device_tile_map(maps: dict, query_start_loc: list[int], first_seq: int, block_m: int, device) -> torch.Tensor:
    """The step's tile map for ``block_m`` (``build_tile_map``), built and uploaded
    (``pagoda.kernels.host_upload``) on first use and kept in ``maps``."""
    tiles = maps.get(block_m)
    if tiles is None:
        tiles = maps[block_m] = upload(build_tile_map(query_start_loc, first_seq, block_m), device)
    return tiles


def build_tile_map(query_start_loc: list[int], first_seq: int, block_m: int) -> np.ndarray:
    """[(sequence index, first query token)] for every BLOCK_M tile of sequences
    ``first_seq..``, as an int32 array [num_tiles, 2]."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    lens = qsl[first_seq + 1:] - qsl[first_seq:-1]
    tiles = -(-lens // block_m)
    seqs = np.repeat(np.arange(first_seq, first_seq + len(lens)), tiles)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)
    starts = (np.arange(len(seqs)) - first) * block_m
    return np.stack([seqs, starts], axis=1).astype(np.int32)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, tile_map: torch.Tensor,
                  out: torch.Tensor, scale: float, sliding_window: int | None = None,
                  soft_cap: float | None = None, config: tuple[int, int, int, int] | None = None,
                  kv_scales: dict | None = None, q_rope: torch.Tensor | None = None,
                  k_rope: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> None:
    """q [T, nq, D], out [T, nq, Dv] over the whole batch (rows addressed through
    query_start_loc); caches [num_blocks, block_size, nk, D] and [..., Dv] (Dv may differ from
    D: MLA's expanded keys and values); tile_map [num_tiles, 2] int32 from ``build_tile_map``
    with BLOCK_M of ``prefill_config(D, Dv)``; ``kv_scales`` ({"k_scale", "v_scale"}): an
    fp8 cache holding k / k_scale (k_rope included) and v / v_scale. ``q_rope`` [T, nq, R] and ``k_rope`` [num_blocks,
    block_size, R] (shared by every KV head), given together: the queries and keys are
    [q | q_rope] and [k | k_rope], D + R wide, read from both tensors without concatenating
    them (MLA's expanded prefill). Any strides but the last."""
    num_tiles = tile_map.shape[0]
    if num_tiles == 0:
        return
    _, nq, head = q.shape
    rope = q_rope.shape[-1] if q_rope is not None else 0
    head_v = v_cache.shape[-1]
    nk, page = k_cache.shape[2], k_cache.shape[1]
    if q_rope is None:
        q_rope, k_rope = q, k_cache  # no rotary part (placeholders, never read)
    # ``config`` (kernel sweeps) must keep the BLOCK_M the tile map was built with
    block_m, block_n, num_warps, num_stages = config or prefill_config(head + rope, head_v)
    _prefill_kernel[(num_tiles, nq)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables, block_tables.stride(0),
        block_tables.stride(1), seq_lens, query_start_loc, tile_map,
        out, out.stride(0), out.stride(1), float(scale), float(soft_cap or 0.0), int(sliding_window or 0),
        kv_scales["k_scale"] if kv_scales else seq_lens, kv_scales["v_scale"] if kv_scales else seq_lens,
        q_rope, q_rope.stride(0), q_rope.stride(1), k_rope, k_rope.stride(0), k_rope.stride(1),
        sinks if sinks is not None else seq_lens, HAS_SINKS=sinks is not None,
        HAS_SCALE=bool(kv_scales), GROUP=nq // nk, HEAD=head, BLOCK_D=max(16, next_pow2(head)), HEAD_V=head_v,
        BLOCK_DV=max(16, next_pow2(head_v)), BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page,
        USE_WINDOW=bool(sliding_window), USE_CAP=bool(soft_cap), UPCAST=interpreting(),
        IEEE=q.dtype == torch.float32, ROPE=rope, BLOCK_R=max(16, next_pow2(rope)),
        DOT_F16=k_cache.element_size() == 1 and q.dtype != torch.float32, num_warps=num_warps,
        num_stages=num_stages)
