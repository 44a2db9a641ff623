"""Paged decode attention (one query token per sequence), split along the context.

One program per (sequence, KV head, split): it loads the query rows of every query head
that shares the KV head (GQA group, padded to 16 rows for the matrix units) and streams
that head's K and V pages once, so each cached byte is read once per step. With
``num_splits > 1`` each program covers one slice of the context and writes a partial
result plus its log-sum-exp; a second kernel merges the slices. The split count depends
only on the batch size (and a length hint), never on device values, so the launch can
be captured in a CUDA graph. Each key tile goes through ``key_tile`` (shared with the prefill
kernel; every row is the newest token). An fp8 cache is widened to fp16 for the dots (the queries too)
and its per-layer scales multiply the scores and the output, not every element. Attention
sinks (one logit per query head, GPT-OSS) join the softmax's denominator at the end: in the
program's normalisation without splits, in the merge with them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_cuda._triton import interpreting, next_pow2, pdl, sm_count, to_f16, wait_for_inputs
from pagoda_cuda.attention.key_tile import key_tile

LOG2E = tl.constexpr(1.4426950408889634)  # a global a kernel reads must be a constexpr


@triton.jit
def _decode_kernel(q_ptr, stride_qt, stride_qh, k_cache, v_cache, stride_cb, stride_cs, stride_ch,
                   tables_ptr, stride_tb, stride_tn, seq_lens_ptr, out_ptr, stride_ot, stride_oh,
                   part_out_ptr, part_lse_ptr, scale, soft_cap, window, k_scale_ptr, v_scale_ptr, sinks_ptr,
                   num_decodes_ptr, MIXED: tl.constexpr,
                   GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   USE_WINDOW: tl.constexpr, USE_CAP: tl.constexpr, UPCAST: tl.constexpr,
                   IEEE: tl.constexpr, HAS_SCALE: tl.constexpr, HEADS_ADJACENT: tl.constexpr,
                   DOT_F16: tl.constexpr, HAS_SINKS: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    if HEADS_ADJACENT:  # the KV heads of one sequence run side by side: together they read whole pages
        kvh = tl.program_id(0)
        b = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    if MIXED:  # a captured batch with prefill chunks: only its first num_decodes sequences decode
        if b >= tl.load(num_decodes_ptr):
            return
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    lo = 0
    if USE_WINDOW:  # the query (position seq_len - 1) sees keys > seq_len - 1 - window
        lo = tl.maximum(seq_len - window, 0)
    span = seq_len - lo
    per_split = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    rows = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = rows < GROUP
    dmask = d < HEAD
    heads = kvh * GROUP + rows
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    elif DOT_F16:  # an fp8 cache widens to fp16 faster than to bf16 (H200: 148 vs 179 us per layer at
        # Qwen3-0.6B's shape); |q| is kept within fp16's range (scores keep float32 accumulation)
        q = to_f16(q)
    v_scale = 1.0
    if HAS_SCALE:  # an fp8 cache holds k / k_scale and v / v_scale: the scales multiply the
        # scores and the output, not every loaded element (that made the fp8 cache slower than bf16)
        scale = scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table_row = tables_ptr + b.to(tl.int64) * stride_tb
    k_base = k_cache + kvh.to(tl.int64) * stride_ch
    v_base = v_cache + kvh.to(tl.int64) * stride_ch
    qpos = tl.full([BLOCK_H], 0, tl.int32) + seq_len - 1  # every row is the sequence's newest token
    r = tl.arange(0, 16)  # no rotary part (MLA only)
    for n0 in range(start, end, BLOCK_N):
        acc, m_i, l_i = key_tile(acc, m_i, l_i, q, q, n0, end, qpos, window, table_row, stride_tn, k_base, v_base,
                                 stride_cb, stride_cs, stride_cb, stride_cs, k_cache, 0, 0, d, dmask, d, dmask, r,
                                 r < 0, scale, soft_cap, BLOCK_N, PAGE, True, USE_WINDOW, USE_CAP, UPCAST, IEEE, 0)

    if HAS_SCALE:
        acc = acc * v_scale
    if NUM_SPLITS == 1:
        if HAS_SINKS:  # exp(sink) joins the denominator (log2 domain, like m_i)
            sink = tl.load(sinks_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * LOG2E
            l_i = l_i + tl.exp2(sink - m_i)
        out = acc / l_i[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])
    else:
        # partials [B, num_heads, NUM_SPLITS, BLOCK_D] and lse [B, num_heads, NUM_SPLITS] (log2 domain)
        num_heads = num_kv_heads * GROUP
        base = (b.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        empty = l_i == 0.0
        safe_l = tl.where(empty, 1.0, l_i)
        out = acc / safe_l[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(safe_l))
        tl.store(part_out_ptr + base[:, None] * BLOCK_D + d[None, :], out, mask=hmask[:, None] & dmask[None, :])
        tl.store(part_lse_ptr + base, lse, mask=hmask)


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, sinks_ptr, num_decodes_ptr,
                  MIXED: tl.constexpr, HEAD: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    b = tl.program_id(0).to(tl.int64)
    if MIXED:
        if b >= tl.load(num_decodes_ptr):
            return
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < NUM_SPLITS
    base = (b * num_heads + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + s, mask=smask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    w = tl.where(smask & (lse > float("-inf")), tl.exp2(lse - top), 0.0)
    parts = tl.load(part_out_ptr + (base + s)[:, None] * BLOCK_D + d[None, :], mask=smask[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    if HAS_SINKS:  # the sink's mass joins the denominator
        total += tl.exp2(sink - top)
    out = tl.sum(parts * w[:, None], axis=0) / total
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD)


def choose_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough programs to fill the GPU (about four per multiprocessor), at least 256 tokens
    per split, at most 64 splits; 1 (no merge pass) once the batch alone fills the GPU."""
    programs = max(1, num_seqs * num_kv_heads)
    target = 4 * sm_count(device)
    if programs >= target:
        return 1
    splits = min(-(-target // programs), max(1, -(-max_seq_len // 256)), 64)
    return max(1, next_pow2(splits) if splits > 1 else 1)


HEADS_ADJACENT = True  # measured faster (phi3-mini shape 554 -> 529 us; qwen3 shapes equal or better)


def decode_config(head: int, group: int, fp8: bool = False) -> tuple[int, int, int, bool]:
    """(BLOCK_N, num_warps, num_stages, heads adjacent) for a head size, GQA group and cache
    element size (``fp8``: one byte). Heads adjacent: programs are ordered KV head fastest, so
    the heads of one sequence read each cache page together."""
    block_d = next_pow2(head)
    if block_d >= 256:
        return 32, 4, 2, HEADS_ADJACENT
    if group > 8:
        return 32, 4, 2, HEADS_ADJACENT
    if fp8 and head == block_d:
        # H200, B256, context 640, fp16 dots: Qwen3-0.6B's 16/8 x 128 148 us against 163 us with
        # 64-key tiles; Phi-3's 32 x 96 (padded to 128) is faster with 64 (577 against 611 us)
        return 128, 4, 3, HEADS_ADJACENT
    return 64, 4, 3, HEADS_ADJACENT


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, out: torch.Tensor, scale: float, num_splits: int,
                 sliding_window: int | None = None, soft_cap: float | None = None,
                 config: tuple | None = None, kv_scales: dict | None = None,
                 sinks: torch.Tensor | None = None, num_decodes: torch.Tensor | None = None) -> None:
    """q [B, nq, D] (one token per sequence), caches [num_blocks, block_size, nk, D],
    block_tables [B, W] (any strides), seq_lens [B] int32 -> out [B, nq, D]. ``config``
    (BLOCK_N, num_warps, num_stages[, heads adjacent]) overrides ``decode_config`` (kernel
    sweeps); ``kv_scales``
    ({"k_scale", "v_scale"} float32 0-dim): an fp8 cache holding k / k_scale; ``sinks`` [nq]:
    per-head sink logits; ``num_decodes`` ([1] int32 on the device, a captured batch that mixes prefill chunks
    in: ``pagoda.engine.mixed_graphs``): only rows below it decode, the others are left as they are."""
    b, nq, head = q.shape
    if b == 0:
        return
    nk, page = k_cache.shape[2], k_cache.shape[1]
    group = nq // nk
    block_h = max(16, next_pow2(group))
    block_d = max(16, next_pow2(head))
    fp8 = k_cache.element_size() == 1
    block_n, num_warps, num_stages, adjacent = (tuple(config) + (HEADS_ADJACENT,))[:4] if config else \
        decode_config(head, group, fp8=fp8)
    upcast = interpreting()
    ieee = q.dtype == torch.float32
    early = pdl(q.device)
    common = dict(PDL=early, launch_pdl=early, HAS_SCALE=bool(kv_scales), GROUP=group, BLOCK_H=block_h,
                  HEAD=head, BLOCK_D=block_d, BLOCK_N=block_n, PAGE=page, NUM_SPLITS=num_splits,
                  USE_WINDOW=bool(sliding_window), USE_CAP=bool(soft_cap), UPCAST=upcast, IEEE=ieee,
                  HEADS_ADJACENT=bool(adjacent), DOT_F16=fp8 and not ieee, HAS_SINKS=sinks is not None,
                  num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        part_out = torch.empty((b, nq, num_splits, block_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((b, nq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(nk, b, num_splits) if adjacent else (b, nk, num_splits)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables, block_tables.stride(0), block_tables.stride(1), seq_lens, out, out.stride(0), out.stride(1),
        part_out, part_lse, float(scale), float(soft_cap or 0.0), int(sliding_window or 0),
        kv_scales["k_scale"] if kv_scales else seq_lens, kv_scales["v_scale"] if kv_scales else seq_lens,
        sinks if sinks is not None else seq_lens, num_decodes if num_decodes is not None else seq_lens,
        MIXED=num_decodes is not None, **common)
    if num_splits > 1:
        _merge_kernel[(b, nq)](part_out, part_lse, out, out.stride(0), out.stride(1),
                               sinks if sinks is not None else seq_lens,
                               num_decodes if num_decodes is not None else seq_lens, MIXED=num_decodes is not None,
                               HEAD=head, BLOCK_D=block_d,
                               NUM_SPLITS=num_splits, BLOCK_S=max(2, next_pow2(num_splits)),
                               HAS_SINKS=sinks is not None, PDL=early, num_warps=4, launch_pdl=early)
