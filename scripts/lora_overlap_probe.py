"""Probe (issue 20): does the LoRA update overlap its layer's base GEMM when the two run on two streams
of one CUDA graph? Qwen3-0.6B's 28 layers x 4 adapted projections (own weights each, so they come
from HBM as in the engine), T tokens cycling over ``adapters`` rank-16 adapters, replayed from one
graph per variant:
  base        the GEMMs alone
  sequential  GEMM, then the fused LoRA kernel adding into its output (the engine today)
  overlapped  side stream: zero a delta, fused kernel into it; main: the GEMM; join; y += delta
  stacked     one GEMM over the weight stacked with every adapter's A ([N + S*R, K]: the base output and
              every adapter's shrink), then the expand from its output in place (lora_expand_stacked)
  stacked_gemm  that GEMM alone; stacked_copy  stacked, then its strided output copied to a contiguous y
Prints us per step (all 112 projections) and per projection. Run on a CUDA machine:
  python scripts/lora_overlap_probe.py [--tokens 64] [--adapters 1 16]
"""

from __future__ import annotations

import argparse

import torch
import triton
from pagoda.lora.ops import max_tiles, token_tiles
from pagoda_cuda.kernel_bench import LORA_LAYERS
from pagoda_cuda.ops.lora import lora_expand_stacked, lora_fused

LAYERS = 28


def build(tokens: int, adapters: int, rank: int = 16):
    projections = []
    for _ in range(LAYERS):
        for k, n, pieces in LORA_LAYERS.values():
            r = rank * len(pieces)
            b = torch.zeros(adapters, n, r, device="cuda", dtype=torch.bfloat16)
            offset = 0
            for i, size in enumerate(pieces):
                b[:, offset:offset + size, i * rank:(i + 1) * rank] = torch.randn(adapters, size, rank, device="cuda")
                offset += size
            projections.append({
                "x": torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16),
                "w": torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5,
                "a": torch.randn(adapters, r, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5,
                "b": b / 4, "pieces": pieces, "y": torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16),
                "delta": torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)})
            p = projections[-1]
            p["stacked"] = torch.cat([p["w"], p["a"].reshape(-1, k)])
            p["out"] = torch.empty(tokens, p["stacked"].shape[0], device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(tokens) % adapters
    order = torch.argsort(slots, stable=True)
    tiles = torch.from_numpy(token_tiles(slots[order].numpy(), pad_to=max_tiles(tokens, adapters))).cuda()
    return projections, slots.cuda(), order.cuda(), tiles


def variants(projections, slots, order, tiles, side: torch.cuda.Stream):
    """name -> a step: the variant's work for one projection, run over all of them."""
    linear = torch.nn.functional.linear

    def base(p):
        linear(p["x"], p["w"], out=p["y"])

    def sequential(p):
        linear(p["x"], p["w"], out=p["y"])
        lora_fused(p["x"], p["y"], p["a"], p["b"], slots, order, tiles, p["pieces"])

    def overlapped(p):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            p["delta"].zero_()
            lora_fused(p["x"], p["delta"], p["a"], p["b"], slots, order, tiles, p["pieces"])
        linear(p["x"], p["w"], out=p["y"])
        main.wait_stream(side)
        p["y"].add_(p["delta"])

    def stacked_gemm(p):
        linear(p["x"], p["stacked"], out=p["out"])

    def stacked(p):
        stacked_gemm(p)
        return lora_expand_stacked(p["out"], p["w"].shape[0], p["b"], slots, order, tiles, p["pieces"])

    def stacked_copy(p):
        p["y"].copy_(stacked(p))

    def over_all(one):
        def step():
            for p in projections:
                one(p)
        return step

    return {fn.__name__: over_all(fn) for fn in (base, sequential, overlapped, stacked_gemm, stacked, stacked_copy)}


def replay_seconds(fn) -> float:
    """Seconds per call of ``fn`` replayed from a CUDA graph (triton's timer: a warm-up, then many calls)."""
    return triton.testing.do_bench_cudagraph(fn) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--variants", nargs="+", default=None, help="a subset of the variants (base first)")
    args = parser.parse_args()
    side = torch.cuda.Stream()
    print("| tokens | adapters | variant | us per step (112 projections) | us per projection | LoRA cost vs base |")
    print("| --- | --- | --- | --- | --- | --- |")
    for tokens in args.tokens:
        for adapters in args.adapters:
            projections, slots, order, tiles = build(tokens, adapters)
            fns = variants(projections, slots, order, tiles, side)
            if args.variants:
                fns = {name: fns[name] for name in ["base"] + [v for v in args.variants if v != "base"]}
            ref = None
            results = {}
            for name, fn in fns.items():
                results[name] = replay_seconds(fn)
                if name not in ("base", "stacked_gemm", "stacked"):  # the variants agree (stacked: as its copy)
                    y = torch.cat([p["y"].float().flatten() for p in projections])
                    ref = y if ref is None else ref
                    err = (y - ref).abs().max().item()
                    assert err < 0.05 * ref.abs().max().item(), (name, err)
            for name, seconds in results.items():
                cost = seconds / results["base"] - 1
                per = seconds * 1e6 / len(projections)
                print(f"| {tokens} | {adapters} | {name} | {seconds * 1e6:.1f} | {per:.2f} | {cost:+.0%} |")


if __name__ == "__main__":
    main()
