#!/usr/bin/env bash
# The second GPU call of a session, after scripts/gpu_check.sh, on a 2-GPU machine (nvidia-h200-x2):
# quantization (kernels at real shapes, phi3-mini throughput in fp8/int4 at 256 prompts and bf16/fp8/int4
# at 8 prompts) and tensor/expert parallelism (scripts/gpu_tp_check.sh: equality, qwen3-30b-a3b at TP=2
# and EP=2), each under a timeout. Everything is packed into $OUT/extra.tgz (the device tool returns at
# most 8 files) with the two summaries beside it.
#   EXTRA_SECTIONS="quant tp prefill"   prefill: qwen3-0.6b with a larger step token budget
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/extra}
RES=$(mktemp -d)
EXTRA_SECTIONS=${EXTRA_SECTIONS:-"quant tp prefill"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s)
say() { echo "[extra +$(( $(date +%s) - T0 ))s] $*" | tee -a "$RES/extra.log"; }

mkdir -p "$OUT"
LOG="$RES/extra.log"
# shellcheck source=scripts/gpu_install.sh
. scripts/gpu_install.sh

bench() {  # name, timeout, args...
  local name=$1 limit=$2
  shift 2
  say "bench $name: $*"
  timeout "$limit" $PY -m pagoda.cli.main bench throughput --ignore-eos --json "$RES/bench-$name.json" "$@" \
    >"$RES/bench-$name.txt" 2>&1 || say "bench $name failed or timed out"
  grep -E "output tok/s|of the bound|roofline" "$RES/bench-$name.txt" | head -3 | tee -a "$RES/extra.log"
}

if [[ " $EXTRA_SECTIONS " == *" quant "* ]]; then
  say "quant kernels at real shapes"
  timeout 300 $PY -m pagoda_cuda.quant.gpu_check --json "$RES/quant-kernels.json" >"$RES/quant-kernels.txt" 2>&1 \
    || say "quant kernels failed or timed out"
  tail -25 "$RES/quant-kernels.txt" | tee -a "$RES/extra.log"
  for q in fp8 int4; do bench "phi3-$q-256" 120 --shape phi3-mini --quantization "$q"; done
  for q in none fp8 int4; do
    qarg=(); [ "$q" = none ] || qarg=(--quantization "$q")
    bench "phi3-$q-8" 90 --shape phi3-mini --num-prompts 8 "${qarg[@]}"
  done
fi
if [[ " $EXTRA_SECTIONS " == *" prefill "* ]]; then
  bench "qwen3-0.6b-budget16k" 90 --shape qwen3-0.6b --max-num-batched-tokens 16384
fi
if [[ " $EXTRA_SECTIONS " == *" tp "* ]]; then
  say "tensor/expert parallel check"
  OUT="$RES/tp" SECTIONS="equality bench" MODES="tp2 ep2" EQUALITY_TIMEOUT=150 BENCH_TIMEOUT=150 \
    SITE="$SITE" bash scripts/gpu_tp_check.sh 2>&1 | tail -25 | tee -a "$RES/extra.log"
fi
say "done"
cp "$RES/extra.log" "$OUT/" 2>/dev/null
[ -f "$RES/tp/summary.json" ] && cp "$RES/tp/summary.json" "$OUT/tp-summary.json"
# results only (the TP check also leaves checkpoints in $RES/tp)
(cd "$RES" && find . \( -name "*.json" -o -name "*.txt" -o -name "*.log" \) -size -4M -print0 \
  | tar czf "$OUT/extra.tgz" --null -T -)
