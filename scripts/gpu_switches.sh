#!/usr/bin/env bash
# pagoda-cuda's switches (docs/cuda.md; on by default since they were measured, nineteenth session), measured in
# one call on one Hopper GPU (nvidia-h200), within about 7 minutes: PAGODA_CUDA_SKINNY_ROWS (the product of a
# few rows) and PAGODA_CUDA_PDL (programmatic dependent launch of the decode path's kernels).
#   1. their gpu-marked tests (bit-identical results with and without PDL, eagerly and from a graph; the
#      product against torch at real shapes)
#   2. scripts/skinny_linear_probe.py --quick: the product against cuBLAS per layer shape, with and without PDL
#   3. scripts/gpu_latency.sh over the four combinations (qwen3-0.6b at batch 1 and 8, phi3-mini at batch 1)
#   4. pagoda bench throughput --lora 16 and the base (Qwen3-0.6B shape, 64 prompts) without and with PDL
#      (the LoRA update itself launches plainly: with PDL it was slower)
# Each section under its own timeout; the tables last. Engines capture graphs up to 1,024 tokens
# (--max-cudagraph-capture-size 1024: start-up without the timed large mixed buckets, which only the prefill
# steps would use). Results in $OUT (default out/switches).
# Before the call: the .whl/ set-up of gpu_check.sh. Run (device tool, carry [".whl"]):
#   bash scripts/gpu_switches.sh          SECTIONS="tests probe latency lora" (any subset)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out/switches}
mkdir -p "$OUT"
LOG="$OUT/switches.log"
SECTIONS=${SECTIONS:-"tests probe latency lora"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
say() { echo "[switches +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
has() { [[ " $SECTIONS " == *" $1 "* ]]; }

# shellcheck source=scripts/gpu_install.sh
. scripts/gpu_install.sh

if has tests; then
  say "gpu-marked tests of the switches"
  timeout 150 $PY -m pytest -q -m gpu -rfEs -p no:cacheprovider plugins/cuda/tests/test_pdl.py \
    plugins/cuda/tests/test_linear_kernel.py >"$OUT/tests.txt" 2>&1 || say "tests FAILED or timed out (tests.txt)"
  tail -3 "$OUT/tests.txt" | tee -a "$LOG"
fi
if has probe; then
  say "the product of a few rows against cuBLAS"
  timeout 120 $PY scripts/skinny_linear_probe.py --quick >"$OUT/probe.txt" 2>&1 || say "probe failed or timed out"
fi
if has latency; then
  say "latency over the switches"
  # (the default since the nineteenth session: PDL on, the product to 16 rows; PDL=0 alone turns both off)
  variants="default PAGODA_CUDA_SKINNY_ROWS=0 PAGODA_CUDA_PDL=0 PAGODA_CUDA_PDL=0,PAGODA_CUDA_SKINNY_ROWS=16"
  export BENCH_ARGS="--max-cudagraph-capture-size 1024"
  SKIP_INSTALL=1 OUT="$OUT/latency" SHAPES=qwen3-0.6b BATCHES="1 8" VARIANTS="$variants" ITERS=2 RUN_TIMEOUT=60 \
    timeout 240 bash scripts/gpu_latency.sh >/dev/null 2>&1 || say "latency (qwen3-0.6b) failed or timed out"
  SKIP_INSTALL=1 OUT="$OUT/latency-phi3" SHAPES=phi3-mini BATCHES=1 VARIANTS="$variants" ITERS=2 RUN_TIMEOUT=60 \
    timeout 150 bash scripts/gpu_latency.sh >/dev/null 2>&1 || say "latency (phi3-mini) failed or timed out"
fi
if has lora; then
  for pdl in 0 1; do
    for n in 0 16; do
      lora=(); [ "$n" = 0 ] || lora=(--lora "$n" --lora-rank 16)
      say "bench qwen3-0.6b, 64 prompts, $n adapters, PAGODA_CUDA_PDL=$pdl"
      PAGODA_CUDA_PDL=$pdl timeout 70 $PY -m pagoda.cli.main bench throughput --shape qwen3-0.6b --num-prompts 64 \
        --input-len 256 --output-len 128 --ignore-eos --repeats 2 --warmup-prompts 64 --max-num-seqs 64 \
        --max-cudagraph-capture-size 1024 --json "$OUT/lora-$n-pdl$pdl.json" "${lora[@]}" >"$OUT/lora-$n-pdl$pdl.txt" 2>&1 \
        || say "bench with $n adapters (PDL $pdl) failed or timed out"
    done
  done
fi
say "done"
{
  [ -f "$OUT/probe.txt" ] && grep -E "^\|" "$OUT/probe.txt"
  for f in "$OUT/latency/summary.txt" "$OUT/latency-phi3/summary.txt"; do [ -f "$f" ] && cat "$f"; done
  $PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rate = {}
for pdl in (0, 1):
    for n in (0, 16):
        try:
            rate[n, pdl] = json.loads((out / f"lora-{n}-pdl{pdl}.json").read_text())["best"]["output_tok_s"]
        except (OSError, ValueError, KeyError):
            rate[n, pdl] = None
if any(v is not None for v in rate.values()):
    print("| PAGODA_CUDA_PDL | base tok/s | 16 adapters tok/s | 16 adapters / base |")
    print("| --- | --- | --- | --- |")
    for pdl in (0, 1):
        base, lora = rate[0, pdl], rate[16, pdl]
        fmt = lambda v: "failed" if v is None else f"{v:,.0f}"  # noqa: E731
        ratio = f"{lora / base:.2f}" if base and lora else "n/a"
        print(f"| {pdl} | {fmt(base)} | {fmt(lora)} | {ratio} |")
PYEOF
} 2>&1 | tee "$OUT/summary.txt" | tee -a "$LOG"
