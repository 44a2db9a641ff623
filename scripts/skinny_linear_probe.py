"""Probe (issue 17, batch-1 latency): pagoda-cuda's skinny ``linear`` (pagoda_cuda.ops.linear) against
torch's (cuBLAS) at the decode shapes of Qwen3-0.6B and Phi-3-mini, M = 1 and 8 rows. Each case
chains one GEMM per layer over distinct weights (so they come from HBM, as in a decode step) and is
timed replayed from a CUDA graph. Prints, per shape and M: cuBLAS us per call and GB/s, the best
config of the sweep and its us and GB/s, the config the module picks, and that config launched with
programmatic dependent launch (each kernel's leading weight columns loaded while the one before it runs;
Hopper); a table last.
  python scripts/skinny_linear_probe.py [--rows 1 8] [--quick]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
from pagoda_cuda import _triton
from pagoda_cuda._triton import sm_count
from pagoda_cuda.ops.linear import skinny_config, skinny_linear

SHAPES = {  # name: (K, N, layers)
    "qwen3-0.6b qkv": (1024, 4096, 28), "qwen3-0.6b o": (2048, 1024, 28),
    "qwen3-0.6b gate_up": (1024, 6144, 28), "qwen3-0.6b down": (3072, 1024, 28),
    "phi3-mini qkv": (3072, 9216, 32), "phi3-mini o": (3072, 3072, 32),
    "phi3-mini gate_up": (3072, 16384, 32), "phi3-mini down": (8192, 3072, 32),
}
SWEEP = list(itertools.product((16, 32, 64), (128, 256, 512), ((4, 3), (4, 5), (8, 4))))


def replay_us(fn) -> float:
    """Microseconds per call of ``fn`` replayed from a CUDA graph (triton's timer: a warm-up, then many calls)."""
    return triton.testing.do_bench_cudagraph(fn) * 1e3


def measure(name: str, k: int, n: int, layers: int, m: int, sweep: bool) -> tuple:
    """One row of the table: (name, M, cuBLAS us, GB/s, chosen config, us, best config, us, GB/s, chosen
    config's us under programmatic dependent launch or None)."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(layers)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, weights[0])
    err = (skinny_linear(x, weights[0]).float() - ref.float()).abs().max().item()
    assert err <= 0.02 * ref.float().abs().max().item() + 1e-3, (name, m, err)
    cublas = replay_us(lambda: [torch.nn.functional.linear(x, w) for w in weights]) / layers
    chosen_cfg = skinny_config(n, k, sm_count(x.device))
    chosen = replay_us(lambda: [skinny_linear(x, w) for w in weights]) / layers
    best_cfg, best = chosen_cfg, chosen
    for bn, bk, (warps, stages) in SWEEP if sweep else ():
        cfg = (bn, bk, warps, stages)
        try:
            us = replay_us(lambda cfg=cfg: [skinny_linear(x, w, config=cfg) for w in weights]) / layers
        except Exception as exc:  # noqa: BLE001 (a config that does not compile or fit)
            print(f"  {name} M={m} {cfg}: {type(exc).__name__}")
            continue
        if us < best:
            best_cfg, best = cfg, us
    with_pdl = None
    if torch.cuda.get_device_capability() >= (9, 0):
        _triton.PDL_REQUESTED, _triton._PDL = True, {}
        try:
            with_pdl = replay_us(lambda: [skinny_linear(x, w) for w in weights]) / layers
        finally:
            _triton.PDL_REQUESTED, _triton._PDL = False, {}
    nbytes = n * k * 2
    return name, m, cublas, nbytes / cublas / 1e3, chosen_cfg, chosen, best_cfg, best, nbytes / best / 1e3, with_pdl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--quick", action="store_true", help="only the module's configs, no sweep")
    args = parser.parse_args()
    table = []
    for name, (k, n, layers) in SHAPES.items():
        for m in args.rows:
            row = measure(name, k, n, layers, m, not args.quick)
            table.append(row)
            print(f"{name} M={m}: cuBLAS {row[2]:.2f} us ({row[3]:.0f} GB/s); chosen {row[4]} {row[5]:.2f} us; "
                  f"best {row[6]} {row[7]:.2f} us ({row[8]:.0f} GB/s); chosen with PDL {row[9]} us", flush=True)
    print("| shape | M | cuBLAS us | GB/s | chosen config | us | with PDL us | best config | us | GB/s | "
          "best / cuBLAS |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, m, cub, cub_bw, ccfg, cus, bcfg, bus, bbw, pus in table:
        pdl_us = "n/a" if pus is None else f"{pus:.2f}"
        print(f"| {name} | {m} | {cub:.2f} | {cub_bw:.0f} | {ccfg} | {cus:.2f} | {pdl_us} | {bcfg} | {bus:.2f} | "
              f"{bbw:.0f} | {bus / cub:.2f} |")


if __name__ == "__main__":
    main()
