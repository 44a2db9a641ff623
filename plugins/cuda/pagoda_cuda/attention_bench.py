"""Attention kernel timings for ``kernel_bench`` (``python -m pagoda_cuda.kernel_bench``), and how a row is timed.

``bench_decode`` (paged decode, bf16 or fp8 cache, head- or token-major pages), ``bench_prefill``,
``bench_mla_decode``, ``bench_mla_prefill`` and ``bench_sparse_mla`` time the attention kernels at real
model shapes over random paged caches (``_paged``): the chosen tile and, with ``sweep``, others.
``_bench`` (the median of ``triton.testing.do_bench``) and ``_timed`` (one row: time, and GB/s or TFLOP/s)
are what every section of ``kernel_bench`` records its rows with.
"""

from __future__ import annotations

import torch
import triton


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def _timed(rows: list, kernel: str, shape: str, config, fn, nbytes: float = 0, flops: float = 0) -> float | None:
    """Time ``fn`` and add a row (time, and GB/s or TFLOP/s for the bytes or FLOPs given); a tile
    that does not build or fit (shared memory) is reported in its row and gives None."""
    try:
        t = _bench(fn)
    except Exception as exc:
        rows.append({"kernel": kernel, "shape": shape, "config": config, "error": str(exc).splitlines()[0][:120]})
        return None
    row = {"kernel": kernel, "shape": shape, "config": config, "seconds": t}
    if nbytes:
        row["GB/s"] = nbytes / t / 1e9
    if flops:
        row["TFLOP/s"] = flops / t / 1e12
    rows.append(row)
    return t


def _paged(batch: int, ctx: int, nk: int, hd: int, block: int = 16, dtype=torch.bfloat16, head_major: bool = True):
    """A random paged cache [2, blocks, block, nk, hd] (pages in random order); ``head_major``
    (the triton backend's layout): each page stores each head's tokens together ([2, blocks,
    nk, block, hd] in memory, the same shape seen through a transpose); else token-major."""
    blocks = batch * (-(-ctx // block))
    if head_major:
        cache = torch.randn(2, blocks, nk, block, hd, device="cuda", dtype=dtype).transpose(2, 3)
    else:
        cache = torch.randn(2, blocks, block, nk, hd, device="cuda", dtype=dtype)
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    return cache, tables, lens


def bench_decode(rows: list, nq: int, nk: int, hd: int, batch: int, ctx: int, sweep: bool,
                 fp8: bool = False) -> None:
    """The decode kernel at one shape (``fp8``: over an fp8 cache with scales)."""
    from pagoda_cuda.attention.decode import choose_splits, decode_config, paged_decode

    q = torch.randn(batch, nq, hd, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    nbytes = batch * ctx * nk * hd * 2 * (1 if fp8 else 2)
    if fp8:  # the chosen tile and, with ``sweep``, longer key tiles (a byte-sized tile holds twice the keys)
        cache, tables, lens = _paged(batch, ctx, nk, hd)
        cache = cache.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda", dtype=torch.float32)
        splits = choose_splits(batch, nk, ctx, q.device)
        configs = [decode_config(hd, nq // nk, fp8=True)]
        if sweep:
            configs += [(64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2), (64, 4, 4), (32, 4, 4)]
        for cfg in dict.fromkeys(configs):
            _timed(rows, "decode attention fp8 cache", f"B{batch} ctx{ctx} nq{nq} nk{nk} d{hd}", cfg,
                   lambda cfg=cfg: paged_decode(q, cache[0], cache[1], tables, lens, out, hd ** -0.5, splits,
                                                config=cfg, kv_scales={"k_scale": one, "v_scale": one}),
                   nbytes=nbytes)
        return
    chosen = choose_splits(batch, nk, ctx, q.device)
    default = decode_config(hd, nq // nk)
    configs = [(default, chosen)]
    if sweep:  # tiles, and two splits where the chosen count is one (a partial last wave of programs)
        configs += [(cfg, chosen) for cfg in [(64, 4, 2), (128, 4, 2), (64, 4, 4), (128, 4, 3), (32, 4, 3),
                                               (32, 4, 4), (32, 2, 4), (64, 8, 3), (128, 8, 3)]]
        configs += [(cfg, 2 * chosen) for cfg in [(64, 4, 3), (32, 4, 4)]]
    # the other program order, and two more tiles: also tried on token-major pages
    others = [(default[:3] + (not default[3],), chosen), ((128, 4, 3, True), chosen), ((64, 4, 2, True), chosen)]
    configs += others if sweep else []
    layouts = (True, False) if sweep else (True,)
    for head_major in layouts:
        paged = _paged(batch, ctx, nk, hd, head_major=head_major)
        shape = f"B{batch} ctx{ctx} nq{nq} nk{nk} d{hd}" + ("" if head_major else " token-major pages")
        for cfg, splits in dict.fromkeys(configs if head_major else configs[:1] + others):
            _timed(rows, "decode attention", f"{shape} splits{splits}", cfg,
                   lambda cfg=cfg, splits=splits, paged=paged: paged_decode(
                       q, paged[0][0], paged[0][1], paged[1], paged[2], out, hd ** -0.5, splits, config=cfg),
                   nbytes=nbytes)
        del paged


def bench_prefill(rows: list, nq: int, nk: int, hd: int, seqs: int, length: int, sweep: bool) -> None:
    from pagoda_cuda.attention.prefill import build_tile_map, paged_prefill, prefill_config

    cache, tables, lens = _paged(seqs, length, nk, hd)
    q = torch.randn(seqs * length, nq, hd, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    qsl = [i * length for i in range(seqs + 1)]
    qsl_t = torch.tensor(qsl, device="cuda", dtype=torch.int32)
    flops = seqs * nq * hd * 4 * length * (length + 1) / 2
    configs = [prefill_config(hd)]
    if sweep:
        configs += [(64, 64, 4, 2), (64, 32, 4, 3), (64, 32, 2, 2), (32, 32, 4, 2), (128, 32, 4, 3), (64, 16, 4, 2)]
    for cfg in dict.fromkeys(configs):
        tiles = torch.from_numpy(build_tile_map(qsl, 0, cfg[0])).cuda()
        _timed(rows, "prefill attention", f"{seqs}x{length} nq{nq} nk{nk} d{hd}", cfg,
               lambda cfg=cfg, tiles=tiles: paged_prefill(q, cache[0], cache[1], tables, lens, qsl_t, tiles, out,
                                                          hd ** -0.5, config=cfg),
               flops=flops)


def bench_mla_decode(rows: list, batch: int, ctx: int, sweep: bool, heads: int = 128, lora: int = 512,
                     rope: int = 64) -> None:
    """DeepSeek-V3's MLA decode over the latent cache: the chosen tile and, with ``sweep``, wider
    head blocks (BLOCK_H, BLOCK_N, num_warps, num_stages)."""
    from pagoda_cuda.attention.mla_decode import mla_config, mla_decode, mla_splits

    blocks = batch * (-(-ctx // 16))
    cache = torch.randn(blocks, 16, lora + rope, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q_lat = torch.randn(batch, heads, lora, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, heads, rope, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q_lat)
    nbytes = batch * ctx * (lora + rope) * 2
    flops = batch * heads * ctx * (2 * lora + rope) * 2
    configs = [mla_config(lora)]
    if sweep:
        configs += [(16, 32, 8, 2), (32, 32, 8, 2), (16, 32, 4, 2), (16, 64, 4, 2), (32, 64, 4, 2), (32, 16, 4, 2),
                    (32, 32, 4, 3), (32, 32, 4, 1), (64, 32, 4, 2), (64, 32, 8, 2)]
    for cfg in dict.fromkeys(configs):
        splits = mla_splits(batch, heads, ctx, torch.device("cuda"), lora, block_h=cfg[0])
        _timed(rows, "mla decode", f"B{batch} ctx{ctx} h{heads} splits{splits}", cfg,
               lambda cfg=cfg, splits=splits: mla_decode(q_lat, q_pe, cache, tables, lens, out, 0.1, splits,
                                                         config=cfg),
               nbytes=nbytes, flops=flops)


def bench_sparse_mla(rows: list, batch: int, ctx: int, sweep: bool, heads: int = 128, lora: int = 512,
                     rope: int = 64, index_heads: int = 64, index_dim: int = 128, topk: int = 2048) -> None:
    """DeepSeek-V3.2's sparse attention decode: the indexer logits over the whole context, the
    top-2048, and MLA over the chosen tokens (the chosen tile and, with ``sweep``, others)."""
    from pagoda_cuda.attention.sparse_mla import index_logits, sparse_mla, sparse_mla_config

    blocks = batch * (-(-ctx // 64))
    cache = torch.randn(blocks, 64, lora + rope + index_dim, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    seq_of = torch.arange(batch, device="cuda", dtype=torch.int32)
    pos = torch.full((batch,), ctx - 1, device="cuda", dtype=torch.int32)
    iq = torch.randn(batch, index_heads, index_dim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(batch, index_heads, device="cuda")
    shape = f"B{batch} ctx{ctx} h{heads} top{topk}"
    _timed(rows, "sparse mla indexer", shape, None,
           lambda: index_logits(iq, w, cache, tables, seq_of, pos, ctx, lora + rope),
           nbytes=batch * ctx * index_dim * 2, flops=2 * batch * ctx * index_heads * index_dim)
    logits = index_logits(iq, w, cache, tables, seq_of, pos, ctx, lora + rope)
    _timed(rows, "sparse mla top-k", shape, None, lambda: logits.topk(topk, dim=-1), nbytes=logits.numel() * 4)
    chosen = logits.topk(topk, dim=-1).indices
    q_lat = torch.randn(batch, heads, lora, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, heads, rope, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q_lat)
    configs = [sparse_mla_config(lora)]
    if sweep:
        configs += [(16, 32, 4, 2), (32, 64, 4, 2), (64, 32, 8, 2), (32, 32, 8, 2), (32, 16, 4, 2)]
    for cfg in dict.fromkeys(configs):
        _timed(rows, "sparse mla attention", shape, cfg,
               lambda cfg=cfg: sparse_mla(q_lat, q_pe, cache, tables, seq_of, chosen, out, 0.1, config=cfg),
               nbytes=batch * topk * (lora + rope) * 2 * -(-heads // cfg[0]),
               flops=2 * batch * heads * topk * (2 * lora + rope))


def bench_mla_prefill(rows: list, seqs: int, length: int, sweep: bool, heads: int = 128, nope: int = 128,
                      rope: int = 64, v: int = 128) -> None:
    """DeepSeek-V3's prefill attention over the expanded latents (keys P + R = 192 wide from two
    tensors, values 128, one-token pages) as ``triton_mla`` runs it: the chosen tile and, with
    ``sweep``, others."""
    from pagoda_cuda.attention.prefill import build_tile_map, paged_prefill, prefill_config

    total = seqs * length
    kv = torch.randn(total, heads, nope + v, device="cuda", dtype=torch.bfloat16)  # the expansion GEMM's output
    keys, values = kv[..., :nope].unsqueeze(1), kv[..., nope:].unsqueeze(1)
    k_rope = torch.randn(total, 1, rope, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(total, heads, nope, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(total, heads, rope, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(total, heads, v, device="cuda", dtype=torch.bfloat16)
    tables = torch.arange(total, device="cuda", dtype=torch.int32).view(seqs, length)
    lens = torch.full((seqs,), length, device="cuda", dtype=torch.int32)
    qsl = [i * length for i in range(seqs + 1)]
    qsl_t = torch.tensor(qsl, device="cuda", dtype=torch.int32)
    flops = seqs * heads * (nope + rope + v) * 2 * length * (length + 1) / 2
    configs = [prefill_config(nope + rope, v)]
    if sweep:
        configs += [(128, 32, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 3), (128, 64, 4, 2), (128, 128, 8, 2)]
    for cfg in dict.fromkeys(configs):
        tiles = torch.from_numpy(build_tile_map(qsl, 0, cfg[0])).cuda()
        _timed(rows, "mla prefill attention", f"{seqs}x{length} h{heads} k{nope + rope} v{v}", cfg,
               lambda cfg=cfg, tiles=tiles: paged_prefill(q, keys, values, tables, lens, qsl_t, tiles, out, 0.07,
                                                          config=cfg, q_rope=q_rope, k_rope=k_rope),
               flops=flops)
