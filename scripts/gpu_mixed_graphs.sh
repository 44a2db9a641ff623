#!/usr/bin/env bash
# Mixed-batch graphs (pagoda.engine.mixed_graphs) on one CUDA GPU: correctness against the eager engine
# (scripts/gpu_mixed_check.py), the gpu-marked attention tests, then issue 16's server benchmark (qwen3-0.6b
# shape, 64 concurrent, JSON schema against unconstrained; scripts/gpu_structured.sh) with cudagraph_mode FULL
# (the default: steps with prefill chunks replayed) and FULL_DECODE_ONLY (those steps eager), interleaved;
# before it, what one joining request costs the running batch in each mode (scripts/mixed_step_cost.py).
# Run (device tool, carry [".whl"]): bash scripts/gpu_mixed_graphs.sh      (about 12 minutes)
# Settings: MODES="FULL FULL_DECODE_ONLY" ROUNDS=1 (0: no server benchmark) CLIENT_PROCESSES=4 REPEATS=2 TESTS=1
#   STEP_COST=1 (scripts/mixed_step_cost.py: a joining request's cost to a 64-sequence batch, per mode)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/mixed}
mkdir -p "$OUT"
LOG="$OUT/mixed.log"
PY=${PYTHON:-python3}
T0=$(date +%s)
say() { echo "[mixed +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
# shellcheck source=scripts/gpu_install.sh
. scripts/gpu_install.sh
status=0
if [ "${TESTS:-1}" = 1 ]; then
  say "correctness: mixed graphs against the eager engine"
  timeout 400 $PY scripts/gpu_mixed_check.py 2>&1 | grep -vE "Writing|Loading|it/s" | tee -a "$LOG" || status=1
  say "gpu-marked attention tests"
  timeout 300 $PY -m pytest -q -m gpu -p no:cacheprovider plugins/cuda/tests/test_attention.py 2>&1 | tail -3 \
    | tee -a "$LOG"
fi
if [ "${STEP_COST:-1}" = 1 ]; then
  say "the cost of a request joining a running batch (scripts/mixed_step_cost.py)"
  $PY scripts/structured_model.py /tmp/pagoda-structured-qwen3 >>"$LOG" 2>&1
  for mode in ${MODES:-FULL FULL_DECODE_ONLY}; do
    timeout 200 $PY scripts/mixed_step_cost.py /tmp/pagoda-structured-qwen3 "$mode" 2>>"$LOG" | tee -a "$LOG"
  done
fi
for round in $(seq 1 "${ROUNDS:-1}"); do
  for mode in ${MODES:-FULL FULL_DECODE_ONLY}; do
    say "round $round: server benchmark, cudagraph_mode $mode"
    OUT="$OUT/$mode-$round" BACKENDS=xgrammar OFFLINE=0 ENGINE_PROCESS=1 CLIENT_PROCESSES=${CLIENT_PROCESSES:-4} \
      REPEATS=${REPEATS:-2} SERVE_ARGS="--cudagraph-mode $mode" bash scripts/gpu_structured.sh >/dev/null 2>&1
    tail -2 "$OUT/$mode-$round/structured.log" | tee -a "$LOG"
    grep -h "mixed_steps\|engine_steps_total" "$OUT/$mode-$round/structured.log" | tail -2 | tee -a "$LOG"
  done
done
say "summary"
$PY - "$OUT" <<'PYEOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
print("| cudagraph_mode, round | unconstrained tok/s | TPOT p50 ms | JSON-schema tok/s | TPOT p50 ms | ratio (median) |")
print("| --- | --- | --- | --- | --- | --- |")
for path in sorted(Path(sys.argv[1]).glob("*/bench-*.json")):
    try:
        r = json.loads(path.read_text())
    except ValueError:
        print(f"| {path.parent.name} | failed |"); continue
    u = r["unconstrained"]
    print(f"| {path.parent.name} | {u['output_tokens_per_s']} | {u.get('tpot_ms', {}).get('p50')} | "
          f"{r['output_tokens_per_s']} | {r.get('tpot_ms', {}).get('p50')} | {r.get('ratio_to_unconstrained')} |")
PYEOF
exit $status
