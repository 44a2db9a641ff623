#!/usr/bin/env bash
# The transformers fallback on one CUDA GPU (nvidia-h200): its gpu-marked tests (tiny Olmo2, Granite and
# OLMoE through the Triton paged attention against transformers: float32 greedy tokens with chunked prefill
# and preemption, bfloat16 logits), then the same random-weight shape benchmarked through the native class
# and through the fallback (model_impl: transformers), and the ratio. Results go to $OUT (default
# out/fallback): fallback_check.log, bench-native.json, bench-fallback.json, summary.json.
#
# Before the call, on the development machine (once): mkdir -p .whl && cp /work/shared/gpu-wheels/*.whl .whl/
# and carry .whl. Settings: SHAPE=qwen3-0.6b NUM_PROMPTS=256 INPUT_LEN=512 OUTPUT_LEN=256 BENCH_TIMEOUT=240
#   run: bash scripts/gpu_fallback_check.sh      (about 5 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/fallback}
mkdir -p "$OUT"
LOG="$OUT/fallback_check.log"
SHAPE=${SHAPE:-qwen3-0.6b}
NUM_PROMPTS=${NUM_PROMPTS:-256}
INPUT_LEN=${INPUT_LEN:-512}
OUTPUT_LEN=${OUTPUT_LEN:-256}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-240}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
say() { echo "[fallback +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

# shellcheck source=scripts/gpu_install.sh
. scripts/gpu_install.sh

say "gpu-marked fallback tests"
timeout 300 $PY -m pytest -q -m gpu -rfEs --timeout 240 -p no:cacheprovider tests/test_transformers_fallback.py 2>&1 \
  | tee -a "$LOG" | tail -15
say "tests done (exit ${PIPESTATUS[0]})"

for impl in native fallback; do
  args=()
  [ "$impl" = fallback ] && args=(--model-impl transformers)
  say "bench $SHAPE ($impl): $NUM_PROMPTS prompts x $INPUT_LEN in x $OUTPUT_LEN out"
  timeout "$BENCH_TIMEOUT" $PY -m pagoda.cli.main bench throughput --shape "$SHAPE" --num-prompts "$NUM_PROMPTS" \
    --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos --repeats 1 --json "$OUT/bench-$impl.json" \
    "${args[@]}" 2>&1 | grep -v -E "^(USDT|STAGE:)" | tee -a "$LOG" | tail -8
  [ "${PIPESTATUS[0]}" = 0 ] || say "bench $impl failed or timed out"
done

$PY - "$OUT" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {}
for impl in ("native", "fallback"):
    path = out / f"bench-{impl}.json"
    if path.is_file():
        rows[impl] = json.loads(path.read_text())["best"]["output_tok_s"]
summary = dict(rows, ratio=rows["fallback"] / rows["native"] if len(rows) == 2 else None)
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print("output tok/s:", {k: round(v) for k, v in rows.items()}, "fallback/native:",
      f"{summary['ratio']:.2f}" if summary["ratio"] else "-")
EOF
