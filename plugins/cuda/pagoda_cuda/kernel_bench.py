"""Kernel timings at real model shapes on a GPU: ``python -m pagoda_cuda.kernel_bench [--json FILE]``.

Each line gives the median time (``triton.testing.do_bench``), the bytes or FLOPs the kernel
must move or compute, and the rate reached. The decode-attention sweep tries several
(BLOCK_N, num_warps, num_stages[, heads adjacent]) tiles; ``decode_config`` holds the chosen ones.

The attention sections and the timing helpers are ``pagoda_cuda.attention_bench``; this module holds the
fused-MoE sections and tile tuner (``--tune-moe``), the small ops, the decode GEMMs, LoRA and the command line.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from pagoda_cuda.attention_bench import (
    _bench,
    _timed,
    bench_decode,
    bench_mla_decode,
    bench_mla_prefill,
    bench_prefill,
    bench_sparse_mla,
)


def bench_moe(rows: list, tokens: int, hidden: int, inner: int, experts: int, topk: int,
              groups: tuple[int, ...] = ()) -> None:
    """The chosen tiles, and the same tiles with each GROUP_M of ``groups`` (1: the plain
    row-block-major order)."""
    from pagoda_cuda.ops.moe import fused_moe, moe_config

    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(experts, 2 * inner, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inner, device="cuda", dtype=torch.bfloat16) / inner ** 0.5
    weights, ids = torch.softmax(torch.randn(tokens, experts, device="cuda"), -1).topk(topk, dim=-1)
    chosen = moe_config(tokens * topk, experts, hidden, inner, x.device, x.dtype)
    hit = min(experts, tokens * topk)
    nbytes = hit * 3 * hidden * inner * 2
    flops = tokens * topk * 3 * hidden * inner * 2
    configs = [chosen] + [chosen[:5] + (g,) for g in groups] + [chosen[:6] + (tma,) for tma in (0, 1)]
    for cfg in dict.fromkeys(configs):
        _timed(rows, "fused moe", f"T{tokens} H{hidden} I{inner} E{experts} k{topk}", cfg,
               lambda cfg=cfg: fused_moe(x, w13, w2, weights, ids, config=cfg), nbytes=nbytes, flops=flops)


# MoE shapes of the benchmark models: experts, hidden, expert intermediate, top-k
MOE_SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "deepseek-v3-4l": (256, 7168, 2048, 8)}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M, weight descriptors) tried for decode
# (256 tokens) and an 8,192-token prefill step; the pointer-load candidates are the previous
# sweep's best few
MOE_CANDIDATES = {
    256: [(32, 64, 128, 4, 3, 1, 0), (16, 64, 128, 4, 4, 1, 0), (16, 128, 128, 4, 3, 1, 0),
          (32, 64, 128, 4, 3, 1, 1), (16, 64, 128, 4, 4, 1, 1), (16, 128, 128, 4, 3, 1, 1),
          (32, 64, 128, 4, 4, 1, 1), (16, 64, 128, 4, 6, 1, 1), (32, 128, 64, 4, 4, 1, 1)],
    8192: [(128, 128, 64, 8, 3, 4, 0), (128, 128, 64, 8, 3, 8, 0), (128, 128, 64, 8, 4, 8, 0),
           (128, 128, 64, 8, 3, 4, 1), (128, 128, 64, 8, 4, 4, 1), (128, 128, 64, 8, 3, 8, 1),
           (128, 128, 128, 8, 3, 4, 1), (128, 64, 128, 8, 4, 4, 1), (64, 128, 64, 4, 4, 4, 1)],
}


def tune_moe(rows: list, out_path: str | None, install: bool) -> None:
    """Time every candidate tile per MoE shape and load; keep the fastest in a table that
    ``moe_config`` reads (installed into the package with ``install``)."""
    import re

    from pagoda_cuda.ops.moe import CONFIG_DIR, fused_moe, shape_key

    name = torch.cuda.get_device_name()
    table = {"device": name, "shapes": {}}
    for model, (experts, hidden, inner, topk) in MOE_SHAPES.items():
        w13 = torch.randn(experts, 2 * inner, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
        w2 = torch.randn(experts, hidden, inner, device="cuda", dtype=torch.bfloat16) / inner ** 0.5
        entries = []
        for tokens, candidates in MOE_CANDIDATES.items():
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            weights, ids = torch.softmax(torch.randn(tokens, experts, device="cuda"), -1).topk(topk, dim=-1)
            best = None
            inputs = (x, w13, w2, weights, ids)
            nbytes = min(experts, tokens * topk) * 3 * hidden * inner * 2
            for cfg in candidates:
                t = _timed(rows, "fused moe (tune)", f"{model} T{tokens}", cfg,
                           lambda cfg=cfg, inputs=inputs: fused_moe(*inputs, config=cfg),
                           nbytes=nbytes, flops=tokens * topk * 6 * hidden * inner)
                if t is not None and (best is None or t < best[0]):
                    best = (t, cfg)
            if best is not None:
                entries.append([tokens * topk / experts, list(best[1])])
        w13 = w2 = inputs = None  # free this shape's weights before the next
        torch.cuda.empty_cache()
        table["shapes"][shape_key(experts, hidden, inner)] = entries
    text = json.dumps(table, indent=1)
    if out_path:
        with open(out_path, "w") as f:
            f.write(text)
    if install:
        CONFIG_DIR.mkdir(parents=True, exist_ok=True)
        (CONFIG_DIR / f"fused_moe_{re.sub(r'[^A-Za-z0-9]+', '_', name)}.json").write_text(text)


def bench_small_ops(rows: list, tokens: int) -> None:
    from pagoda.layers.rotary import get_rope

    from pagoda_cuda.ops.activation import silu_and_mul
    from pagoda_cuda.ops.norm import fused_add_rms_norm
    from pagoda_cuda.ops.rotary import rotary_embedding

    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    rows.append({"kernel": "fused_add_rms_norm", "shape": f"{tokens}x1024",
                 "seconds": _bench(lambda: fused_add_rms_norm(x, x, w, 1e-6))})
    cache = get_rope(128, 128, 4096, None).cos_sin_cache.cuda()
    q = torch.randn(tokens, 16 * 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, 8 * 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (tokens,), device="cuda")
    rows.append({"kernel": "rotary", "shape": f"{tokens} tokens 16+8 heads x128",
                 "seconds": _bench(lambda: rotary_embedding(pos, q, k, 128, cache, True))})
    # DeepSeek-V3's MLA rotary part at a 16,384-token prefill step: 128 query heads x 64 and one
    # key head, interleaved pairs (neox for comparison); bytes read + written
    big = 16384
    qd = torch.randn(big, 128 * 64, device="cuda", dtype=torch.bfloat16)
    kd = torch.randn(big, 64, device="cuda", dtype=torch.bfloat16)
    pd = torch.randint(0, 4096, (big,), device="cuda")
    cd = get_rope(64, 64, 4096, None).cos_sin_cache.cuda()
    for neox in (False, True):
        t = _bench(lambda neox=neox: rotary_embedding(pd, qd, kd, 64, cd, neox))
        rows.append({"kernel": "rotary", "shape": f"{big} tokens 128+1 heads x64 {'neox' if neox else 'interleaved'}",
                     "seconds": t, "GB/s": 2 * (qd.numel() + kd.numel()) * 2 / t / 1e9})
    g = torch.randn(tokens, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    rows.append({"kernel": "silu_and_mul", "shape": f"{tokens}x2x3072", "seconds": _bench(lambda: silu_and_mul(g))})
    a = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    t = _bench(lambda: torch.nn.functional.linear(a, b))
    rows.append({"kernel": "cuBLAS linear (reference)", "shape": f"{tokens}x1024 @ 1024x4096", "seconds": t,
                 "GB/s": b.numel() * 2 / t / 1e9})


# decode-step GEMMs at batch 256 (out features, in features): qwen3-0.6b's qkv, o, gate/up, down and
# lm_head; phi3-mini's qkv, o, gate/up, down; deepseek-v3-4l's dense gate/up, dense down, MLA o_proj
DECODE_GEMMS = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024),
                (9216, 3072), (3072, 3072), (16384, 3072), (3072, 8192), (36864, 7168), (7168, 18432),
                (7168, 16384)]


def bench_decode_gemms(rows: list, tokens: int = 256) -> None:
    """torch's linear (cuBLAS) at decode shapes. (Splitting K into 2-8 slices of one batched GEMM
    with float32 partials was slower at every shape here, 1.1-6x; docs/benchmarks.md.)"""
    a = torch.randn(tokens, 18432, device="cuda", dtype=torch.bfloat16)
    for n, k in DECODE_GEMMS:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = a[:, :k].contiguous()
        _timed(rows, "linear (cuBLAS)", f"{tokens}x{k} @ {k}x{n}", "",
               lambda x=x, w=w: torch.nn.functional.linear(x, w), nbytes=(w.numel() + x.numel() + tokens * n) * 2,
               flops=2 * tokens * n * k)
        del w


# Qwen3-0.6B's adapted layers with rank-16 adapters on every projection: (name, K, N, pieces)
LORA_LAYERS = {"qkv": (1024, 4096, (2048, 1024, 1024)), "o": (2048, 1024, (1024,)),
               "gate_up": (1024, 6144, (3072, 3072)), "down": (3072, 1024, (1024,))}
LORA_FUSED_SWEEP = {  # (BLOCK_N, BLOCK_K, programs per SM, num_warps) tried besides the chosen one
    # (a wider sweep at c283437 chose the defaults: docs/benchmarks.md)
    "decode": [(128, 128, 2, 4), (128, 256, 1, 4), (64, 128, 1, 4), (64, 128, 2, 4)],
    "prefill": [(256, 128, 2, 4), (128, 128, 1, 4)],
}


def bench_lora(rows: list, tokens: int, adapters: int, layer: str = "qkv", sweep: bool = False,
               rank: int = 16) -> None:
    """The LoRA update of one of Qwen3-0.6B's layers (``LORA_LAYERS``; a fused layer has a rank-16 block
    per piece, B block-diagonal as pagoda.lora.layers writes it) for a batch whose rows cycle over
    ``adapters`` slots, the tiles padded as the decode graphs pad them: shrink then expand (two
    launches) and the fused kernel (one), against the layer's base GEMM. Decode-sized batches are
    timed replayed from a CUDA graph (as decode steps run), larger ones (prefill, eager) with plain
    launches; ``sweep`` tries the fused kernel's other tiles."""
    from pagoda.lora.ops import max_tiles, token_tiles

    from pagoda_cuda.ops.lora import DECODE_TOKENS, fused_config, lora_expand, lora_fused, lora_shrink

    k, n, pieces = LORA_LAYERS[layer]
    r = rank * len(pieces)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(adapters, r, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = torch.zeros(adapters, n, r, device="cuda", dtype=torch.bfloat16)
    offset = 0
    for i, size in enumerate(pieces):
        b[:, offset:offset + size, i * rank:(i + 1) * rank] = torch.randn(adapters, size, rank, device="cuda")
        offset += size
    slots = torch.arange(tokens) % adapters
    order = torch.argsort(slots, stable=True)
    tiles = torch.from_numpy(token_tiles(slots[order].numpy(), pad_to=max_tiles(tokens, adapters))).cuda()
    slots, order = slots.cuda(), order.cuda()
    y = torch.nn.functional.linear(x, w)
    decode = tokens <= DECODE_TOKENS
    shape = f"{layer} T={tokens} K={k} N={n} R={r} adapters={adapters}"
    nbytes = (a.numel() + b.numel() + x.numel() + 2 * y.numel()) * 2
    how = "CUDA graph" if decode else "eager"

    def timed(kernel, config, fn):
        if not decode:
            return _timed(rows, kernel, shape, config, fn, nbytes=nbytes)
        try:  # replayed from a CUDA graph, as in decode steps: no Python launch cost
            t = triton.testing.do_bench_cudagraph(fn) / 1e3
        except Exception as exc:
            rows.append({"kernel": kernel, "shape": shape, "config": config, "error": str(exc).splitlines()[0][:120]})
            return None
        rows.append({"kernel": kernel, "shape": shape, "config": config, "seconds": t, "GB/s": nbytes / t / 1e9})
        return t

    two = lambda: lora_expand(y, lora_shrink(x, a, slots, order, tiles), b, slots, order, tiles)  # noqa: E731
    timed("lora shrink+expand", f"{how}, {tiles.shape[1]} tiles", two)
    chosen = fused_config(tokens)
    timed("lora fused", f"{how}, chosen {chosen}", lambda: lora_fused(x, y, a, b, slots, order, tiles, pieces))
    if sweep:
        for cfg in LORA_FUSED_SWEEP["decode" if decode else "prefill"]:
            if cfg != chosen:
                timed("lora fused", f"{how} {cfg}",
                      lambda cfg=cfg: lora_fused(x, y, a, b, slots, order, tiles, pieces, config=cfg))
    _timed(rows, "linear (cuBLAS)", shape, "the base GEMM", lambda: torch.nn.functional.linear(x, w),
           nbytes=(w.numel() + x.numel() + y.numel()) * 2)


def lora_cases(sweep: bool) -> list[tuple[int, int, str, bool]]:
    """(tokens, adapters, layer, sweep): every layer at decode sizes with 1 and 16 adapters and at a
    prefill size; qkv also at T=256."""
    cases = [(64, 1, "qkv"), (64, 16, "qkv"), (256, 16, "qkv"), (4096, 4, "qkv")]
    cases += [(t, s, layer) for layer in ("o", "gate_up", "down") for t, s in ((64, 1), (64, 16), (4096, 4))]
    return [(t, s, layer, sweep) for t, s, layer in cases]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda_cuda.kernel_bench", description=__doc__)
    parser.add_argument("--json", help="write the rows as JSON")
    parser.add_argument("--no-sweep", action="store_true", help="time only the chosen decode tiles")
    parser.add_argument("--tune-moe", metavar="FILE", help="sweep fused-MoE tiles for the benchmark shapes and "
                        "write the fastest per shape and load to FILE")
    parser.add_argument("--install-tuned", action="store_true", help="with --tune-moe: also install the table "
                        "into this package's configs/ (used from then on)")
    parser.add_argument("--only", help="comma-separated prefixes of the sections to time (e.g. decode, "
                        "decode:qwen3-30b-a3b, prefill, mla, sparse-mla, moe, small, gemm, lora); default: all")
    args = parser.parse_args(argv)
    rows: list[dict] = []
    steps = []
    if args.tune_moe:
        steps.append(lambda: tune_moe(rows, args.tune_moe, args.install_tuned))
    sweep = not args.no_sweep
    sections = [  # (name, step); --only takes name prefixes
        ("decode:qwen3-0.6b", lambda: bench_decode(rows, 16, 8, 128, 256, 640, sweep)),
        ("decode:qwen3-0.6b-524", lambda: bench_decode(rows, 16, 8, 128, 256, 524, sweep)),  # its mean context
        ("decode:qwen3-0.6b-576", lambda: bench_decode(rows, 16, 8, 128, 256, 576, False)),  # 9 whole tiles
        ("decode:qwen3-0.6b-fp8", lambda: bench_decode(rows, 16, 8, 128, 256, 640, sweep, fp8=True)),
        ("decode:phi3-mini-fp8", lambda: bench_decode(rows, 32, 32, 96, 256, 640, sweep, fp8=True)),
        ("decode:phi3-mini", lambda: bench_decode(rows, 32, 32, 96, 256, 640, sweep)),
        ("decode:qwen3-30b-a3b", lambda: bench_decode(rows, 32, 4, 128, 256, 640, sweep)),
        ("decode:long", lambda: bench_decode(rows, 16, 8, 128, 4, 16384, False)),  # long context, split
        ("prefill:qwen3-0.6b", lambda: bench_prefill(rows, 16, 8, 128, 16, 512, sweep)),
        ("prefill:phi3-mini", lambda: bench_prefill(rows, 32, 32, 96, 16, 512, sweep)),
        ("prefill:qwen3-30b-a3b", lambda: bench_prefill(rows, 32, 4, 128, 16, 512, False)),
        ("mla:decode", lambda: bench_mla_decode(rows, 256, 520, sweep)),  # deepseek-v3-4l decode
        ("mla:decode-640", lambda: bench_mla_decode(rows, 256, 640, sweep)),
        ("mla:prefill", lambda: bench_mla_prefill(rows, 16, 512, sweep)),
        ("sparse-mla:decode", lambda: bench_sparse_mla(rows, 256, 4096, sweep)),  # deepseek-v3.2 decode
        ("sparse-mla:decode-32k", lambda: bench_sparse_mla(rows, 32, 32768, False)),
        ("moe:qwen3-30b-a3b", lambda: bench_moe(rows, 256, 2048, 768, 128, 8, (1, 4))),  # decode
        ("moe:qwen3-30b-a3b-prefill", lambda: bench_moe(rows, 8192, 2048, 768, 128, 8, (1, 4, 16))),
        ("moe:deepseek-v3-4l-prefill", lambda: bench_moe(rows, 8192, 7168, 2048, 256, 8, (1, 4, 16))),
        ("small", lambda: bench_small_ops(rows, 256)),
        ("gemm", lambda: bench_decode_gemms(rows)),
        ("lora", lambda: [bench_lora(rows, t, s, layer, sw) for t, s, layer, sw in lora_cases(sweep)]),
    ]
    wanted = tuple(args.only.split(",")) if args.only else ("",)
    steps += [step for name, step in sections if name.startswith(wanted)]
    for step in steps:
        try:
            step()
        except Exception as exc:  # keep going: one failing kernel must not hide the others
            rows.append({"kernel": "error", "error": f"{type(exc).__name__}: {exc}"[:300]})
    for r in rows:
        rate = " ".join(f"{k} {r[k]:,.0f}" for k in ("GB/s", "TFLOP/s") if k in r)
        timing = f"{r['seconds'] * 1e6:9.1f} us" if "seconds" in r else r.get("error", "")
        print(f"{r['kernel']:<26} {r.get('shape', ''):<42} {str(r.get('config', '')):<14} {timing} {rate}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
