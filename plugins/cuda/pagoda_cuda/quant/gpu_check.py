"""GPU check of pagoda-quant's kernels at real shapes: ``python -m pagoda_cuda.quant.gpu_check``.

For the linear layers of a 3.8B (Phi-3-mini) and an 8B (Llama-3-8B) model and a range of
token counts, each GPU op is compared with the torch reference on the same quantized inputs
and timed against the bf16 ``F.linear`` of the same shape:

  fp8_linear        cuBLASLt (torch._scaled_mm) and the Triton GEMM, per-token activations
  fp8_block_linear  Triton block-scaled GEMM (128x128 weight blocks)
  int4_linear       Triton fused dequantize-GEMM (small batches) and dequantize + dense GEMM
  fused_moe_quant   a Qwen3-30B-A3B expert layer (128 experts, top-8), fp8 and int4

Prints a table and writes JSON (``--json``), then an INT4 summary at small batches: per
Phi-3-mini / Llama-3-8B layer and M in INT4_SUMMARY_TOKENS, bf16 time, INT4 time (autotuned and
the fixed configuration), the speedup and the INT4 weight bytes per second against the measured
device copy bandwidth (the byte bound), plus what the first (autotuning) call of each shape cost.
Exit status 1 when any op is outside its tolerance, so scripts/gpu_quant_check.sh fails loudly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial

import torch

# (name, N, K) of every linear shape one decoder layer runs
SHAPES = {
    "phi3-mini": [("qkv", 9216, 3072), ("o", 3072, 3072), ("gate_up", 16384, 3072), ("down", 3072, 8192)],
    "llama3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
}
TOKENS = (1, 8, 16, 32, 64, 256, 4096)
INT4_SUMMARY_TOKENS = (1, 8, 16, 64)  # decode batches, where INT4 must beat bf16
# relative L2 error against the reference allowed for each op (bf16 output rounding, fp32 sum order)
TOLERANCE = {"fp8_linear": 0.01, "fp8_block_linear": 0.01, "int4_linear": 0.01, "fused_moe_quant": 0.02}


def _time_us(fn, iters: int = 20, graphs: bool = True) -> float:
    """Device time of one call as a CUDA graph replays it (as in a decode step), with L2 flushed
    before each call, so that microsecond kernels are timed on the GPU, not on their launch,
    and on weights streamed from HBM. Eager timing where the call cannot be captured, and with
    ``graphs=False`` (long calls, whose launch does not matter)."""
    from pagoda_cuda.quant.int4 import graph_bench

    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    if graphs:
        try:
            return graph_bench(fn, None) * 1e3
        except Exception as exc:  # noqa: BLE001 - report eager timing instead
            print(f"  (graph timing failed: {type(exc).__name__}: {str(exc)[:80]}; eager timing)")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def copy_bandwidth_gbps() -> float:
    """Device memory bandwidth as a 1 GiB device-to-device copy reaches it (read + write bytes)."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    us = _time_us(partial(dst.copy_, src), iters=10, graphs=False)  # as measured before graph timing (4.1 TB/s)
    return 2 * (1 << 30) / us / 1e3


def _first_call_ms(fn) -> float:
    """Wall time of a first call (for INT4: compile + autotune of that shape and batch bucket)."""
    import time

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def _with_env(env: dict, fn):
    """Run fn with environment switches set (the ops read them per call)."""
    old = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def check_linear(model: str, tokens: tuple[int, ...]) -> list[dict]:
    from pagoda_quant.formats import fp8 as f8
    from pagoda_quant.formats import int4 as i4
    from pagoda_quant.kernels import reference

    from pagoda_cuda.quant import dispatch as cuda

    rows = []
    dev = torch.device("cuda")
    for name, n, k in SHAPES[model]:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        wq, ws = f8.quantize_per_channel(w)
        bq, bs = f8.quantize_blockwise(w, (128, 128))
        q, s, z = i4.quantize_groups(w, 128)
        qw, sc, zr = i4.to_kernel_layout(q, s, z, torch.bfloat16)
        weight_bytes = {"bf16": n * k * 2, "fp8": n * k, "int4": n * k // 2 + 2 * 2 * n * k // 128}
        for m in tokens:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            base = _time_us(partial(torch.nn.functional.linear, x, w))
            int4_path = "fused" if m < cuda.INT4_DENSE_MIN_TOKENS else "dequant+gemm"
            cases = [
                ("fp8_linear", "scaled_mm", partial(cuda.fp8_linear, x, wq, ws),
                 partial(reference.fp8_linear, x, wq, ws), "fp8", {"PAGODA_QUANT_FP8_GEMM": "auto"}),
                ("fp8_linear", "triton", partial(cuda.fp8_linear, x, wq, ws),
                 partial(reference.fp8_linear, x, wq, ws), "fp8", {"PAGODA_QUANT_FP8_GEMM": "triton"}),
                ("fp8_block_linear", "triton", partial(cuda.fp8_block_linear, x, bq, bs, (128, 128)),
                 partial(reference.fp8_block_linear, x, bq, bs, (128, 128)), "fp8", {}),
                ("int4_linear", int4_path, partial(cuda.int4_linear, x, qw, sc, zr),
                 partial(reference.int4_linear, x, qw, sc, zr), "int4", {}),
            ]
            for op, path, fn, ref, fmt, env in cases:
                extra = {}
                if op == "int4_linear" and path == "fused":
                    extra["first_call_ms"] = _first_call_ms(fn)
                    if m in INT4_SUMMARY_TOKENS:  # the untuned configuration, for comparison
                        extra["fixed_us"] = _with_env({"PAGODA_QUANT_INT4_AUTOTUNE": "0"}, partial(_time_us, fn))
                err = _rel(_with_env(env, fn), ref())
                us = _with_env(env, partial(_time_us, fn))
                rows.append({"model": model, "layer": name, "N": n, "K": k, "tokens": m, "op": op, "path": path,
                             "rel_error": err, "ok": err < TOLERANCE[op], "us": us, "bf16_us": base,
                             "speedup_vs_bf16": base / us, "weight_GBps": weight_bytes[fmt] / us / 1e3,
                             "TFLOPs": 2 * m * n * k / us / 1e6, **extra})
    return rows


def check_moe(tokens: tuple[int, ...]) -> list[dict]:
    """A Qwen3-30B-A3B expert layer: 128 experts, hidden 2048, moe_intermediate 768, top-8."""
    from pagoda.kernels import activate, get_op
    from pagoda_quant.methods.moe import ExpertWeights, Fp8ExpertsMethod, Int4ExpertsMethod

    activate("cuda")
    dev = torch.device("cuda")
    e, h, inter, top = 128, 2048, 768, 8

    class Layer(torch.nn.Module):
        num_local_experts, expert_start, activation = e, 0, "silu"

    rows = []
    for method in (Fp8ExpertsMethod(None, online=True), Int4ExpertsMethod(128, False)):
        layer = Layer()
        with torch.device(dev):
            method.create_weights(layer, e, h, inter, torch.bfloat16)
        for p in layer.parameters():
            p.data.normal_(0, 0.02)
        w13_full, w2_full = layer.w13_weight.data.clone(), layer.w2_weight.data.clone()
        method.process_weights_after_loading(layer)
        w13, w2 = ExpertWeights(layer, method, "w13"), ExpertWeights(layer, method, "w2")
        quant_moe, dense_moe = get_op("fused_moe_quant"), get_op("fused_moe")
        for m in tokens:
            x = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
            weights, ids = torch.randn(m, e, device=dev).softmax(-1).topk(top)
            fn = partial(quant_moe, x, w13, w2, weights, ids)
            want = dense_moe(x, w13.dequantize_all(torch.bfloat16), w2.dequantize_all(torch.bfloat16), weights, ids)
            err = _rel(fn(), want)
            base = _time_us(partial(dense_moe, x, w13_full, w2_full, weights, ids))
            us = _time_us(fn)
            rows.append({"model": "qwen3-30b-a3b", "layer": "experts", "N": 2 * inter, "K": h, "tokens": m,
                         "op": "fused_moe_quant", "path": method.method_name, "rel_error": err,
                         "ok": err < TOLERANCE["fused_moe_quant"], "us": us, "bf16_us": base,
                         "speedup_vs_bf16": base / us, "weight_GBps": float("nan"), "TFLOPs": float("nan")})
    return rows


def print_int4_summary(rows: list[dict], copy_gbps: float) -> None:
    """INT4 against bf16 at decode batches: does INT4 win, and how close to its byte bound is it."""
    int4 = [r for r in rows if r["op"] == "int4_linear" and r["tokens"] in INT4_SUMMARY_TOKENS]
    if any(r["model"] == "phi3-mini" for r in int4):  # the benchmark shape; the others are in the table above
        int4 = [r for r in int4 if r["model"] == "phi3-mini"]
    if not int4:
        return
    print(f"INT4 W4A16 (group 128) vs bf16 at small batches; byte bound: {copy_gbps:.0f} GB/s device copy")
    print(f"{'model':<11}{'layer':<8}{'N x K':>12}{'M':>4}{'bf16 us':>9}{'int4 us':>9}{'x bf16':>8}{'GB/s':>7}"
          f"{'of bound':>9}{'fixed us':>9}{'1st call ms':>12}")
    for r in int4:
        print(f"{r['model'][:10]:<11}{r['layer']:<8}{r['N']:>6}x{r['K']:<5}{r['tokens']:>4}{r['bf16_us']:>9.1f}"
              f"{r['us']:>9.1f}{r['speedup_vs_bf16']:>8.2f}{r['weight_GBps']:>7.0f}"
              f"{r['weight_GBps'] / copy_gbps:>9.0%}{r.get('fixed_us', float('nan')):>9.1f}"
              f"{r.get('first_call_ms', float('nan')):>12.0f}")
    wins = sum(r["speedup_vs_bf16"] > 1 for r in int4)
    print(f"INT4 faster than bf16 in {wins}/{len(int4)} small-batch cases")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--no-moe", action="store_true")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("pagoda_cuda.quant.gpu_check needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rows = [r for model in args.models for r in check_linear(model, tuple(args.tokens))]
    if not args.no_moe:
        rows += check_moe(tuple(t for t in args.tokens if t <= 1024))
    print(f"{'model':<14}{'layer':<9}{'tokens':>7}  {'op':<17}{'path':<13}{'rel err':>9}{'us':>10}{'bf16 us':>10}"
          f"{'x bf16':>8}{'GB/s':>8}{'TFLOP/s':>9}")
    for r in rows:
        flag = "" if r["ok"] else "  <-- OUT OF TOLERANCE"
        print(f"{r['model']:<14}{r['layer']:<9}{r['tokens']:>7}  {r['op']:<17}{r['path']:<13}{r['rel_error']:>9.2e}"
              f"{r['us']:>10.1f}{r['bf16_us']:>10.1f}{r['speedup_vs_bf16']:>8.2f}{r['weight_GBps']:>8.0f}"
              f"{r['TFLOPs']:>9.1f}{flag}")
    copy_gbps = copy_bandwidth_gbps()
    print_int4_summary(rows, copy_gbps)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": copy_gbps, "rows": rows}, f, indent=1)
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} within tolerance")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
