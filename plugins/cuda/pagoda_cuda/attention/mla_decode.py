"""MLA (DeepSeek-V2/V3) kernels over the paged latent cache [num_blocks, block_size, L + R].

``store_mla_cache`` writes each new token's latent and rotary key part at its slot.
An fp8 cache holds ``clamp(entry / scale)`` with the layer's ``kv_scales["k_scale"]`` (one
scale for latent and k_pe, as ``pagoda.layers.mla`` says); both kernels take it.
``mla_decode`` attends one query token per sequence over the latent with the absorbed
query (``q_lat = q_nope @ w_uk``, [B, N, L]): score = q_lat . c + q_pe . k_pe and the
output is the probability-weighted latent (the caller applies ``w_uv``). One program per
(sequence, block of BLOCK_H heads, split of the context); splits are merged as in ``decode``.
Each program reads its sequence's latent tiles once for all its heads, so wider head blocks
read the cache fewer times and give the matrix units taller tiles (``mla_config``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_cuda._triton import interpreting, mma, next_pow2
from pagoda_cuda.attention.decode import _merge_kernel, choose_splits


@triton.jit
def _store_mla_kernel(c_ptr, stride_c, pe_ptr, stride_pe, cache_ptr, slot_ptr, scale_ptr, limit,
                      LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                      HAS_SCALE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    l_off = tl.arange(0, BLOCK_L)
    r_off = tl.arange(0, BLOCK_R)
    lmask = (l_off < LORA) & (slot >= 0)
    rmask = (r_off < ROPE) & (slot >= 0)
    row = cache_ptr + slot * (LORA + ROPE)
    c = tl.load(c_ptr + t * stride_c + l_off, mask=lmask, other=0.0)
    pe = tl.load(pe_ptr + t * stride_pe + r_off, mask=rmask, other=0.0)
    c = c.to(tl.float32)
    pe = pe.to(tl.float32)
    if HAS_SCALE:  # an fp8 cache holds clamp(entry / scale), rounded to nearest
        scale = tl.load(scale_ptr)
        c = tl.minimum(tl.maximum(c / scale, -limit), limit)
        pe = tl.minimum(tl.maximum(pe / scale, -limit), limit)
    tl.store(row + l_off, c.to(cache_ptr.dtype.element_ty), mask=lmask)
    tl.store(row + LORA + r_off, pe.to(cache_ptr.dtype.element_ty), mask=rmask)


def store_mla_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """kv_c [T, L], k_pe [T, R] into kv_cache [num_blocks, block_size, L + R] at the flat
    slots ``slot_mapping`` [T]; slots < 0 are skipped (padding). With an fp8 cache and a
    float32 0-dim ``scale``, stores clamp(entry / scale)."""
    t = kv_c.shape[0]
    if t == 0:
        return
    lora, rope = kv_c.shape[-1], k_pe.shape[-1]
    kv_c = kv_c if kv_c.stride(-1) == 1 else kv_c.contiguous()
    k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
    if not kv_cache.is_contiguous():
        raise ValueError("store_mla_cache needs a contiguous kv_cache [num_blocks, block_size, L + R]")
    limit = float(torch.finfo(kv_cache.dtype).max) if scale is not None else 0.0
    _store_mla_kernel[(t,)](kv_c, kv_c.stride(0), k_pe, k_pe.stride(0), kv_cache, slot_mapping,
                            scale if scale is not None else slot_mapping, limit, LORA=lora, ROPE=rope,
                            BLOCK_L=next_pow2(lora), BLOCK_R=next_pow2(rope), HAS_SCALE=scale is not None,
                            num_warps=4)


@triton.jit
def _mla_decode_kernel(ql_ptr, stride_qlb, stride_qlh, qp_ptr, stride_qpb, stride_qph, cache_ptr, stride_cb,
                       stride_cs, tables_ptr, stride_tb, stride_tn, seq_lens_ptr, out_ptr, stride_ob, stride_oh,
                       part_out_ptr, part_lse_ptr, scale, kv_scale_ptr, num_heads,
                       LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                       NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                       HAS_SCALE: tl.constexpr):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    hmask = heads < num_heads
    lo = tl.arange(0, BLOCK_L)
    ro = tl.arange(0, BLOCK_R)
    lmask = lo < LORA
    rmask = ro < ROPE
    b64 = b.to(tl.int64)
    q_lat = tl.load(ql_ptr + b64 * stride_qlb + heads[:, None] * stride_qlh + lo[None, :],
                    mask=hmask[:, None] & lmask[None, :], other=0.0)
    q_pe = tl.load(qp_ptr + b64 * stride_qpb + heads[:, None] * stride_qph + ro[None, :],
                   mask=hmask[:, None] & rmask[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    kv_scale = 1.0
    if HAS_SCALE:  # an fp8 cache holds entry / scale: the scale multiplies the scores and the output
        kv_scale = tl.load(kv_scale_ptr)
    qk_scale = scale * kv_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    table_row = tables_ptr + b64 * stride_tb
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        page = tl.load(table_row + (n // PAGE) * stride_tn, mask=nmask, other=0).to(tl.int64)
        row = page * stride_cb + (n % PAGE).to(tl.int64) * stride_cs
        lat = tl.load(cache_ptr + row[:, None] + lo[None, :], mask=nmask[:, None] & lmask[None, :], other=0.0)
        pe = tl.load(cache_ptr + row[:, None] + LORA + ro[None, :], mask=nmask[:, None] & rmask[None, :],
                     other=0.0)
        if UPCAST:
            lat = lat.to(tl.float32)
            pe = pe.to(tl.float32)
        else:
            lat = lat.to(q_lat.dtype)
            pe = pe.to(q_lat.dtype)
        s = mma(q_lat, tl.trans(lat), UPCAST, IEEE) + mma(q_pe, tl.trans(pe), UPCAST, IEEE)
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = mma(p, lat, UPCAST, IEEE)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    acc = acc * kv_scale
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + lo[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & lmask[None, :])
    else:
        base = (b64 * num_heads + heads) * NUM_SPLITS + split
        empty = l_i == 0.0
        safe_l = tl.where(empty, 1.0, l_i)
        out = acc / safe_l[:, None]
        tl.store(part_out_ptr + base[:, None] * BLOCK_L + lo[None, :], out, mask=hmask[:, None] & lmask[None, :])
        tl.store(part_lse_ptr + base, tl.where(empty, float("-inf"), m_i + tl.log2(safe_l)), mask=hmask)


# (BLOCK_H, BLOCK_N, num_warps, num_stages) for the latent widths DeepSeek uses (512 + 64). H200,
# 256 sequences x 520 tokens, 128 heads (kernel_bench): (32, 32, 4, 2) 316 us against 793 us for
# the (16, 32, 8, 2) used before, 524 us with 8 warps, 355 us for 64 heads (8 warps, 2 splits)
MLA_DECODE_CONFIG = (32, 32, 4, 2)


def mla_config(lora: int) -> tuple[int, int, int, int]:
    """The decode tile for a latent width: ``MLA_DECODE_CONFIG`` for wide latents, narrower
    tiles with four warps for the small latents of tests and small models."""
    if max(16, next_pow2(lora)) >= 512:
        return MLA_DECODE_CONFIG
    return 16, 32, 4, 2


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, out: torch.Tensor, scale: float, num_splits: int,
               kv_scale: torch.Tensor | None = None, config: tuple[int, int, int, int] | None = None) -> None:
    """q_lat [B, N, L], q_pe [B, N, R] (last dims contiguous), kv_cache [num_blocks, block_size,
    L + R], block_tables [B, W], seq_lens [B] -> out [B, N, L] (probability-weighted latents).
    ``kv_scale`` (float32 0-dim): an fp8 cache holding entry / kv_scale. ``config`` (BLOCK_H,
    BLOCK_N, num_warps, num_stages) overrides ``mla_config`` (kernel sweeps)."""
    b, heads, lora = q_lat.shape
    if b == 0:
        return
    rope = q_pe.shape[-1]
    page = kv_cache.shape[1]
    block_l, block_r = max(16, next_pow2(lora)), max(16, next_pow2(rope))
    block_h, block_n, num_warps, num_stages = config or mla_config(lora)
    if num_splits > 1:
        part_out = torch.empty((b, heads, num_splits, block_l), dtype=torch.float32, device=q_lat.device)
        part_lse = torch.empty((b, heads, num_splits), dtype=torch.float32, device=q_lat.device)
    else:
        part_out = part_lse = out
    grid = (b, triton.cdiv(heads, block_h), num_splits)
    _mla_decode_kernel[grid](
        q_lat, q_lat.stride(0), q_lat.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1), kv_cache, kv_cache.stride(0),
        kv_cache.stride(1), block_tables, block_tables.stride(0), block_tables.stride(1), seq_lens, out,
        out.stride(0), out.stride(1), part_out, part_lse, float(scale),
        kv_scale if kv_scale is not None else seq_lens, heads, LORA=lora, ROPE=rope,
        BLOCK_H=block_h, BLOCK_L=block_l, BLOCK_R=block_r, BLOCK_N=block_n, PAGE=page, NUM_SPLITS=num_splits,
        UPCAST=interpreting(), IEEE=q_lat.dtype == torch.float32, HAS_SCALE=kv_scale is not None,
        num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        _merge_kernel[(b, heads)](part_out, part_lse, out, out.stride(0), out.stride(1), seq_lens, seq_lens,
                                  MIXED=False, HEAD=lora, BLOCK_D=block_l, NUM_SPLITS=num_splits,
                                  BLOCK_S=max(2, next_pow2(num_splits)), HAS_SINKS=False, PDL=False, num_warps=4)


def mla_splits(num_seqs: int, num_heads: int, max_seq_len: int, device: torch.device, lora: int = 512,
               block_h: int | None = None) -> int:
    """Context splits for a decode batch: ``choose_splits`` over the head blocks of ``block_h``
    heads (default: ``mla_config``'s)."""
    return choose_splits(num_seqs, triton.cdiv(num_heads, block_h or mla_config(lora)[0]), max_seq_len, device)
