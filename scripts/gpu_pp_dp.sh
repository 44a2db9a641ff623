#!/usr/bin/env bash
# Pipeline and data parallelism on a 2-GPU machine (device kind nvidia-h200-x2: it needs two GPUs).
#   1. equality: PP=2 and DP=2 greedy tokens == one GPU on a random Qwen3-30B-A3B-shaped checkpoint
#      with 2 layers at real widths (scripts/gpu_tp_check.py --modes pp2,dp2)
#   2. bench: pagoda bench throughput --shape qwen3-30b-a3b at 1 GPU, PP=2 and DP=2
# then a table with the scaling efficiency (tok/s at 2 GPUs / (2 x tok/s at 1 GPU)). Results in
# $OUT (default out/gpu-pp-dp): gpu_pp_dp.log, equality.txt, bench-<mode>.json.
# Install: like scripts/gpu_check.sh (scripts/gpu_install.sh).
# Settings: SECTIONS="equality bench" MODES="one pp2 dp2" SHAPE=qwen3-30b-a3b NUM_PROMPTS=256
#   INPUT_LEN=512 OUTPUT_LEN=256 BENCH_TIMEOUT=300 (per mode). Everything fits ~4 minutes on 2 x H200
#   with NUM_PROMPTS=128; each section also fits one 10-minute call on its own.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/gpu-pp-dp}
mkdir -p "$OUT"
LOG="$OUT/gpu_pp_dp.log"
SECTIONS=${SECTIONS:-"equality bench"}
MODES=${MODES:-"one pp2 dp2"}
SHAPE=${SHAPE:-qwen3-30b-a3b}
NUM_PROMPTS=${NUM_PROMPTS:-256}
INPUT_LEN=${INPUT_LEN:-512}
OUTPUT_LEN=${OUTPUT_LEN:-256}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-300}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
T0=$(date +%s)
say() { echo "[gpu_pp_dp +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

# shellcheck source=scripts/gpu_install.sh
. scripts/gpu_install.sh
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv 2>&1 | tee -a "$LOG"

if [[ " $SECTIONS " == *" equality "* ]]; then
  say "equality: PP=2 and DP=2 against one GPU ($SHAPE x 2 layers, real widths, float32 and bfloat16)"
  timeout 240 $PY scripts/gpu_tp_check.py --out "$OUT" --shapes "$SHAPE:2" --dtypes float32,bfloat16 \
    --modes pp2,dp2 2>&1 | grep -v -E "^(USDT|STAGE:)" | tee -a "$LOG" "$OUT/equality.txt"
  say "equality done (exit ${PIPESTATUS[0]})"
fi

if [[ " $SECTIONS " == *" bench "* ]]; then
  for mode in $MODES; do
    case "$mode" in
      one) flags=() ;;
      pp2) flags=(--pipeline-parallel-size 2) ;;
      dp2) flags=(--data-parallel-size 2) ;;
      *) say "unknown mode $mode"; continue ;;
    esac
    say "bench $SHAPE $mode: $NUM_PROMPTS x $INPUT_LEN in x $OUTPUT_LEN out ${flags[*]}"
    timeout "$BENCH_TIMEOUT" $PY -m pagoda.cli.main bench throughput --shape "$SHAPE" --num-prompts "$NUM_PROMPTS" \
      --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos --warmup-prompts 16 \
      --json "$OUT/bench-$mode.json" "${flags[@]}" 2>&1 | grep -v -E "^(USDT|STAGE:)" | tee -a "$LOG"
    status=${PIPESTATUS[0]}
    [ "$status" = 0 ] || say "bench $mode failed or timed out (exit $status)"
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader | tee -a "$LOG"  # freed after exit?
  done
fi

$PY - "$OUT" <<'PYEOF' | tee -a "$LOG"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
tok = {}
for mode in ("one", "pp2", "dp2"):
    f = out / f"bench-{mode}.json"
    if f.exists():
        tok[mode] = json.loads(f.read_text())["best"]["output_tok_s"]
print("| mode | output tok/s | scaling efficiency |")
print("| --- | --- | --- |")
for mode, value in tok.items():
    eff = "" if mode == "one" or "one" not in tok else f"{value / (2 * tok['one']):.0%}"
    print(f"| {mode} | {value:,.0f} | {eff} |")
for line in (out / "equality.txt").read_text().splitlines() if (out / "equality.txt").exists() else []:
    if " vs tp1: " in line:
        print("equality", line.strip())
PYEOF
