#!/usr/bin/env bash
# Multi-LoRA on one GPU (issue 20), within about 4 minutes: correctness first (the Triton LoRA kernels at
# real shapes in bf16/fp16, and a mixed batch of two peft adapters plus the base model through the CUDA
# engine against transformers+peft), then `pagoda bench throughput` on qwen3-0.6b (random weights), 64
# prompts, with 0 (base only), 1, 4 and 16 distinct rank-16 adapters on every projection. Prints a table
# last: output tok/s and the cost against the base (issue target: 16 adapters cost <= 20%).
# "0e" (the base model with --enforce-eager) can be added to the counts for the cost of running eagerly;
# a count may carry a variable for its run after a colon, e.g. "16:PAGODA_CUDA_LORA_STACKED_TOKENS=0" (every
# step through lora_fused) beside "16" (the default: steps of up to 256 tokens through the stacked GEMM);
# LORA_PROFILE=16 adds --profile (decode step breakdown) to the run with that many adapters.
# LORA_KERNEL_BENCH="--only lora" (kernel_bench's arguments) times the LoRA kernels last: shrink+expand
# against the fused kernel at each of Qwen3-0.6B's layers, with its tile sweep unless --no-sweep is given.
#   LORA_SHAPE=qwen3-0.6b LORA_INPUT=256 LORA_OUTPUT=128 LORA_COUNTS="0 1 4 16" bash scripts/gpu_lora.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/lora}
RES=$(mktemp -d)
LOG="$RES/install.log"
PY=${PYTHON:-python3}
SHAPE=${LORA_SHAPE:-qwen3-0.6b}
INPUT=${LORA_INPUT:-256}
OUTPUT=${LORA_OUTPUT:-128}
COUNTS=${LORA_COUNTS:-"0 1 4 16"}  # 0e: the base model run eagerly
PROFILE_COUNT=${LORA_PROFILE:-16}
KERNEL_BENCH=${LORA_KERNEL_BENCH:-}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
say() { echo "[lora +$(( $(date +%s) - T0 ))s] $*" | tee -a "$RES/lora.log"; }
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_install.sh
. scripts/gpu_install.sh
$PY -c "import peft" 2>/dev/null || say "peft is not installed (carry its wheel in .whl/): the engine-vs-peft test skips"

say "correctness: Triton LoRA kernels (real shapes) and the CUDA engine against transformers+peft"
timeout 150 $PY -m pytest -q -x plugins/cuda/tests/test_lora_kernels.py "tests/test_lora.py::test_mixed_batch_matches_peft_on_the_gpu" \
  >"$RES/tests.txt" 2>&1 || say "correctness tests FAILED or timed out"
tail -3 "$RES/tests.txt" | tee -a "$RES/lora.log"

for n in $COUNTS; do
  count=${n%%:*}
  tag=${n//[:=]/_}
  vars=(); [ "$count" = "$n" ] || vars=("${n#*:}")
  case $count in 0) lora=() ;; 0e) lora=(--enforce-eager) ;; *) lora=(--lora "$count" --lora-rank 16) ;; esac
  [ "$n" = "$PROFILE_COUNT" ] && lora+=(--profile)
  say "bench $SHAPE, 64 prompts, $count adapters ${vars[*]}"
  env "${vars[@]}" timeout 70 $PY -m pagoda.cli.main bench throughput --shape "$SHAPE" --num-prompts 64 --input-len "$INPUT" \
    --output-len "$OUTPUT" --ignore-eos --repeats 2 --warmup-prompts 64 --max-num-seqs 64 --bandwidth-gbs 4800 --matmul-tflops 990 \
    --json "$RES/bench-$tag.json" "${lora[@]}" >"$RES/bench-$tag.txt" 2>&1 || say "bench with $n adapters failed or timed out"
  grep -E "output tok/s" "$RES/bench-$tag.txt" | head -1 | tee -a "$RES/lora.log"
done

$PY - "$RES" $COUNTS <<'PYEOF' | tee "$RES/table.txt"
import json, sys, pathlib
res, counts = pathlib.Path(sys.argv[1]), sys.argv[2:]
rate = {}
for n in counts:
    f = res / f"bench-{n.replace(':', '_').replace('=', '_')}.json"
    rate[n] = json.loads(f.read_text())["best"]["output_tok_s"] if f.exists() else None  # (n: "16:VAR=0" too)
base = rate.get("0")
print("| adapters | output tok/s | vs base |")
print("| --- | --- | --- |")
for n in counts:
    r = rate[n]
    cost = "" if r is None or not base or n == "0" else f"{100 * (1 - r / base):.1f}% below base"
    print(f"| {n} | {'failed' if r is None else f'{r:,.0f}'} | {cost} |")
PYEOF
if [ -n "$KERNEL_BENCH" ]; then
  say "kernel_bench $KERNEL_BENCH"
  # shellcheck disable=SC2086
  timeout 200 $PY -m pagoda_cuda.kernel_bench $KERNEL_BENCH --json "$RES/kernel_bench.json" >"$RES/kernel_bench.txt" 2>&1 \
    || say "kernel_bench failed or timed out"
  grep -E "^(lora shrink|linear|error)|chosen" "$RES/kernel_bench.txt"; true
fi
cp "$RES"/* "$OUT"/ 2>/dev/null
(cd "$OUT" && tar czf lora.tgz ./*.json ./*.txt ./*.log 2>/dev/null)
say "done; results in $OUT"
