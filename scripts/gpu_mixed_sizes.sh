#!/usr/bin/env bash
# Graphs of steps with prefill chunks above 1,024 tokens (pagoda.engine.mixed_graphs: buckets to the step token
# budget, kept where their replay beats the eager step at start-up) on one CUDA GPU: correctness against the
# eager engine (scripts/gpu_mixed_check.py, 256- to 4,096-token steps), what one joining request of
# PROMPT_LENS tokens costs a 64-sequence batch (scripts/mixed_step_cost.py, FULL against FULL_DECODE_ONLY),
# then `pagoda bench throughput` per shape in SHAPES with the buckets as they are chosen now and with
# --max-cudagraph-capture-size 1024 (the sizes before), the capture decisions from the engine's log.
# Run (device tool, carry [".whl"]): bash scripts/gpu_mixed_sizes.sh      (about 9 minutes)
# Settings: TESTS=1 PROMPT_LENS="64 3000 6000" SHAPES="qwen3-0.6b phi3-mini" STEP_COST=1
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/mixed-sizes}
mkdir -p "$OUT"
LOG="$OUT/sizes.log"
PY=${PYTHON:-python3}
T0=$(date +%s)
say() { echo "[sizes +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
# shellcheck source=scripts/gpu_install.sh
. scripts/gpu_install.sh
status=0
if [ "${TESTS:-1}" = 1 ]; then
  say "correctness: mixed graphs against the eager engine"
  timeout 300 $PY scripts/gpu_mixed_check.py 2>&1 | grep -vE "Writing|Loading|it/s" | tee -a "$LOG" || status=1
fi
if [ "${STEP_COST:-1}" = 1 ]; then
  say "the cost of a request joining a running batch (scripts/mixed_step_cost.py)"
  $PY scripts/structured_model.py /tmp/pagoda-structured-qwen3 >>"$LOG" 2>&1
  for len in ${PROMPT_LENS:-64 3000 6000}; do
    for mode in FULL FULL_DECODE_ONLY; do
      PROMPT_LEN=$len timeout 150 $PY scripts/mixed_step_cost.py /tmp/pagoda-structured-qwen3 "$mode" 2>>"$LOG" \
        | tee -a "$LOG"
    done
  done
fi
for shape in ${SHAPES:-qwen3-0.6b phi3-mini}; do
  for cap in "" 1024; do
    name="$shape${cap:+-cap$cap}"
    say "bench $name"
    start=$(date +%s)
    PAGODA_LOG_LEVEL=INFO timeout 240 $PY -m pagoda.cli.main bench throughput --shape "$shape" --num-prompts 256 \
      --input-len 512 --output-len 256 --ignore-eos --json "$OUT/bench-$name.json" \
      ${cap:+--max-cudagraph-capture-size $cap} >"$OUT/bench-$name.log" 2>&1 || say "bench $name failed"
    say "bench $name took $(( $(date +%s) - start ))s"
    grep -E "captured|run eagerly" "$OUT/bench-$name.log" | tee -a "$LOG"
  done
done
say "summary"
$PY - "$OUT" <<'PYEOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
print("| run | best output tok/s | runs | setup s |")
print("| --- | --- | --- | --- |")
for path in sorted(Path(sys.argv[1]).glob("bench-*.json")):
    try:
        r = json.loads(path.read_text())
    except ValueError:
        print(f"| {path.stem[6:]} | failed | | |"); continue
    runs = [round(x["output_tok_s"]) for x in r["runs"]]
    print(f"| {path.stem[6:]} | {round(r['best']['output_tok_s'])} | {runs} | {r['setup_seconds']:.1f} |")
PYEOF
exit $status
