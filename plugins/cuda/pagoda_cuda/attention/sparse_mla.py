"""DeepSeek sparse attention kernels over the paged cache of ``[latent | k_pe | index_k]``
entries (``pagoda.layers.sparse_mla``), [num_blocks, block_size, L + R + Di].

``index_logits``: the lightning indexer's score of every cached token for every query token,
``sum_h w[h] * relu(q[h] . k)``, -inf past the query's own position; one program per (query
token, tile of BLOCK_N keys), all indexer heads at once (one [Hi, Di] x [Di, BLOCK_N] dot).
Tiles wholly after the query's position only write -inf. The caller takes ``torch.topk``.

``sparse_mla``: attention of each query token over its own list of selected key positions
(``-1``: none), over the latent with the absorbed query (``q_lat = q_nope @ w_uk``): score =
q_lat . c + q_pe . k_pe, output the probability-weighted latent (the caller applies ``w_uv``).
One program per (query token, block of BLOCK_H heads): it gathers the selected tokens' entries
through the block table, BLOCK_N at a time, once for all its heads. Decodes and prefill chunks
are the same case: the selection is per query token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_cuda._triton import interpreting, mma, next_pow2


@triton.jit
def _index_logits_kernel(iq_ptr, stride_qt, stride_qh, w_ptr, stride_wt, cache_ptr, stride_cb, stride_cs,
                         tables_ptr, stride_tb, stride_tn, seq_of_ptr, pos_ptr, out_ptr, stride_ot, width,
                         num_heads, OFFSET: tl.constexpr, HEAD: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, UPCAST: tl.constexpr,
                         IEEE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pos = tl.load(pos_ptr + t)
    out_row = out_ptr + t * stride_ot
    if tl.program_id(1) * BLOCK_N > pos:  # nothing visible in this tile
        tl.store(out_row + n, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=n < width)
        return
    seq = tl.load(seq_of_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = h < num_heads
    dmask = d < HEAD
    q = tl.load(iq_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=hmask[:, None] & dmask[None, :],
                other=0.0)
    w = tl.load(w_ptr + t * stride_wt + h, mask=hmask, other=0.0).to(tl.float32)
    visible = n <= pos
    page = tl.load(tables_ptr + seq * stride_tb + (n // PAGE) * stride_tn, mask=visible, other=0).to(tl.int64)
    rows = page * stride_cb + (n % PAGE).to(tl.int64) * stride_cs + OFFSET
    k = tl.load(cache_ptr + rows[:, None] + d[None, :], mask=visible[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    else:
        k = k.to(q.dtype)
    s = tl.maximum(mma(q, tl.trans(k), UPCAST, IEEE), 0.0)  # [BLOCK_H, BLOCK_N], relu per head
    logits = tl.sum(s * w[:, None], axis=0)
    tl.store(out_row + n, tl.where(visible, logits, float("-inf")), mask=n < width)


def index_logits(index_q: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_of: torch.Tensor, positions: torch.Tensor, width: int, offset: int,
                 block_n: int = 64) -> torch.Tensor:
    """index_q [T, Hi, Di] (last dim contiguous), weights [T, Hi] float32, kv_cache [blocks,
    block_size, L + R + Di] (index keys from ``offset``), block_tables [B, W'], seq_of [T] (each
    token's row of the tables), positions [T] (each token's position) -> logits [T, width] float32."""
    t, heads, head = index_q.shape
    out = torch.empty((t, width), dtype=torch.float32, device=index_q.device)
    if t == 0:
        return out
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    _index_logits_kernel[(t, triton.cdiv(width, block_n))](
        index_q, index_q.stride(0), index_q.stride(1), weights, weights.stride(0), kv_cache, kv_cache.stride(0),
        kv_cache.stride(1), block_tables, block_tables.stride(0), block_tables.stride(1), seq_of, positions, out,
        out.stride(0), width, heads, OFFSET=offset, HEAD=head, BLOCK_H=max(16, next_pow2(heads)),
        BLOCK_D=max(16, next_pow2(head)), BLOCK_N=block_n, PAGE=kv_cache.shape[1], UPCAST=interpreting(),
        IEEE=index_q.dtype == torch.float32, num_warps=4)
    return out


@triton.jit
def _sparse_mla_kernel(ql_ptr, stride_qlt, stride_qlh, qp_ptr, stride_qpt, stride_qph, cache_ptr, stride_cb,
                       stride_cs, tables_ptr, stride_tb, stride_tn, seq_of_ptr, idx_ptr, stride_it, num_selected,
                       out_ptr, stride_ot, stride_oh, scale, num_heads,
                       LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, UPCAST: tl.constexpr,
                       IEEE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    lo = tl.arange(0, BLOCK_L)
    ro = tl.arange(0, BLOCK_R)
    lmask = lo < LORA
    rmask = ro < ROPE
    q_lat = tl.load(ql_ptr + t * stride_qlt + heads[:, None] * stride_qlh + lo[None, :],
                    mask=hmask[:, None] & lmask[None, :], other=0.0)
    q_pe = tl.load(qp_ptr + t * stride_qpt + heads[:, None] * stride_qph + ro[None, :],
                   mask=hmask[:, None] & rmask[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    seq = tl.load(seq_of_ptr + t).to(tl.int64)
    table_row = tables_ptr + seq * stride_tb
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    for j0 in range(0, num_selected, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        sel = tl.load(idx_ptr + t * stride_it + j, mask=j < num_selected, other=-1).to(tl.int64)
        valid = sel >= 0
        page = tl.load(table_row + (sel // PAGE) * stride_tn, mask=valid, other=0).to(tl.int64)
        row = page * stride_cb + (sel % PAGE) * stride_cs
        lat = tl.load(cache_ptr + row[:, None] + lo[None, :], mask=valid[:, None] & lmask[None, :], other=0.0)
        pe = tl.load(cache_ptr + row[:, None] + LORA + ro[None, :], mask=valid[:, None] & rmask[None, :], other=0.0)
        if UPCAST:
            lat = lat.to(tl.float32)
            pe = pe.to(tl.float32)
        else:
            lat = lat.to(q_lat.dtype)
            pe = pe.to(q_lat.dtype)
        s = mma(q_lat, tl.trans(lat), UPCAST, IEEE) + mma(q_pe, tl.trans(pe), UPCAST, IEEE)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with nothing selected yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + mma(p, lat, UPCAST, IEEE)
        m_i = m_new
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + lo[None, :],
             (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=hmask[:, None] & lmask[None, :])


def sparse_mla_config(lora: int) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages): as MLA decode (DeepSeek's 512 + 64 latent: 32 heads,
    32 keys, 4 warps); narrower tiles for the small latents of tests."""
    if max(16, next_pow2(lora)) >= 512:
        return 32, 32, 4, 2
    return 16, 32, 4, 2


def sparse_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_of: torch.Tensor, selected: torch.Tensor, out: torch.Tensor, scale: float,
               config: tuple[int, int, int, int] | None = None) -> None:
    """q_lat [T, N, L], q_pe [T, N, R] (last dims contiguous), kv_cache [blocks, block_size, L + R (+ Di)],
    block_tables [B, W], seq_of [T], selected [T, K] key positions (-1: none) -> out [T, N, L]
    (probability-weighted latents). ``config`` (BLOCK_H, BLOCK_N, num_warps, num_stages) overrides
    ``sparse_mla_config`` (kernel sweeps)."""
    t, heads, lora = q_lat.shape
    if t == 0:
        return
    rope = q_pe.shape[-1]
    block_h, block_n, num_warps, num_stages = config or sparse_mla_config(lora)
    selected = selected if selected.stride(-1) == 1 else selected.contiguous()
    _sparse_mla_kernel[(t, triton.cdiv(heads, block_h))](
        q_lat, q_lat.stride(0), q_lat.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1), kv_cache, kv_cache.stride(0),
        kv_cache.stride(1), block_tables, block_tables.stride(0), block_tables.stride(1), seq_of, selected,
        selected.stride(0), selected.shape[1], out, out.stride(0), out.stride(1), float(scale), heads, LORA=lora,
        ROPE=rope, BLOCK_H=block_h, BLOCK_L=max(16, next_pow2(lora)), BLOCK_R=max(16, next_pow2(rope)),
        BLOCK_N=block_n, PAGE=kv_cache.shape[1], UPCAST=interpreting(), IEEE=q_lat.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages)
