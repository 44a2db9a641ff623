#!/usr/bin/env bash
# The GPU check: install pagoda on a CUDA machine (from carried wheels, no network), run the
# gpu-marked tests, time the Triton kernels at real shapes, run the throughput benchmarks of
# docs/benchmarks.md, and print a short table last. Results go to $OUT (default out/gpu):
#   gpu_check.log        everything printed
#   kernels.json         python -m pagoda_cuda.kernel_bench rows
#   bench-<shape>.json   pagoda bench throughput results (format: docs/benchmarks.md)
#   summary.json         the final table
#
# Before a lent-GPU call, on the development machine (once):
#   mkdir -p .whl && cp /work/shared/gpu-wheels/*.whl .whl/     # .whl/ is git-ignored; carry it
#   (tests/test_structured_outputs.py and test_server_clients.py also need jsonschema, which the GPU machine
#   lacks: pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64
#   -d .whl jsonschema jsonschema-specifications referencing rpds-py attrs)
# Settings (environment variables):
#   SHAPES="qwen3-0.6b phi3-mini qwen3-30b-a3b deepseek-v3-4l gemma3-1b gpt-oss-20b"   shapes to benchmark
#   NUM_PROMPTS=256 INPUT_LEN=512 OUTPUT_LEN=256                  the workload
#   BASELINE_SHAPES="qwen3-0.6b"  BASELINE_MAX_SECONDS=60          HF transformers baseline, capped
#   TESTS=1 TEST_PATHS="tests plugins"  KERNELS=1  PROFILE=1       sections to run
#   TUNE_MOE=0    1: sweep fused-MoE tiles first, install the table for this run (fused_moe_tuned.json)
#   TEST_TIMEOUT=240 KERNEL_TIMEOUT=150 BENCH_TIMEOUT=300           seconds per section / per shape
#   KERNEL_ARGS="--no-sweep"  BENCH_ARGS="--max-num-batched-tokens 8192"   extra arguments
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/gpu}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
SHAPES=${SHAPES:-"qwen3-0.6b phi3-mini qwen3-30b-a3b deepseek-v3-4l gemma3-1b gpt-oss-20b"}
NUM_PROMPTS=${NUM_PROMPTS:-256}
INPUT_LEN=${INPUT_LEN:-512}
OUTPUT_LEN=${OUTPUT_LEN:-256}
BASELINE_SHAPES=${BASELINE_SHAPES:-"qwen3-0.6b"}
BASELINE_MAX_SECONDS=${BASELINE_MAX_SECONDS:-60}
TESTS=${TESTS:-1}
TEST_PATHS=${TEST_PATHS:-"tests plugins"}
KERNELS=${KERNELS:-1}
TUNE_MOE=${TUNE_MOE:-0}
PROFILE=${PROFILE:-1}
TEST_TIMEOUT=${TEST_TIMEOUT:-240}
KERNEL_TIMEOUT=${KERNEL_TIMEOUT:-150}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-300}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)

say() { echo "[gpu_check +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

# ------------------------------------------------------------------ install
# shellcheck source=scripts/gpu_install.sh
. scripts/gpu_install.sh
$PY - <<'EOF' 2>&1 | tee -a "$LOG"
import torch, triton, pagoda
print("torch", torch.__version__, "| triton", triton.__version__, "| pagoda", pagoda.__version__,
      "| cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
from pagoda.plugins import get_registry
reg = get_registry()
print("plugins:", [(p.name, p.error.splitlines()[-1] if p.error else "ok") for p in reg.plugins])
EOF
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv >>"$LOG" 2>&1

# ------------------------------------------------------------------ tests
if [ "$TESTS" = 1 ]; then
  say "gpu-marked tests in: $TEST_PATHS"
  # shellcheck disable=SC2086
  timeout "$TEST_TIMEOUT" $PY -m pytest -q -m gpu -rfEs --timeout 180 -p no:cacheprovider $TEST_PATHS 2>&1 \
    | tee -a "$LOG" | tail -15
  say "tests done (exit ${PIPESTATUS[0]})"
  # not gpu-marked (they run on CPU in CI too), but on this machine they take the CUDA device:
  # tiny models against transformers through the Triton kernels, eager and graphs, step pipeline on
  say "whole-model checks on the GPU: plugins/cuda/tests/test_model_triton.py"
  timeout "$TEST_TIMEOUT" $PY -m pytest -q -rfEs --timeout 180 -p no:cacheprovider \
    plugins/cuda/tests/test_model_triton.py 2>&1 | tee -a "$LOG" | tail -15
  say "whole-model checks done (exit ${PIPESTATUS[0]})"
fi

# ------------------------------------------------------------------ kernels
if [ "$KERNELS" = 1 ]; then
  say "kernel timings at real shapes"
  tune=()
  [ "$TUNE_MOE" = 1 ] && tune=(--tune-moe "$OUT/fused_moe_tuned.json" --install-tuned)
  # shellcheck disable=SC2086
  timeout "$KERNEL_TIMEOUT" $PY -m pagoda_cuda.kernel_bench --json "$OUT/kernels.json" "${tune[@]}" ${KERNEL_ARGS:-} 2>&1 \
    | tee -a "$LOG"
fi

# ------------------------------------------------------------------ benchmarks
registered() {  # exit 0: the shape's architecture is registered; 3: it is not; 4: no such shape
  $PY - "$1" <<'EOF'
import sys
from pagoda.bench.shapes import SHAPES
from pagoda.plugins import get_registry
spec = SHAPES.get(sys.argv[1])
if spec is None:
    sys.exit(4)
sys.exit(0 if spec["architectures"][0] in get_registry().models else 3)
EOF
}
for shape in $SHAPES; do
  registered "$shape"
  case $? in
    0) ;;
    4) say "SKIP $shape: no such shape (see pagoda.bench.shapes)"; continue ;;
    *) say "SKIP $shape: its architecture is not registered (model plugin missing)"; continue ;;
  esac
  extra=()
  [ "$PROFILE" = 1 ] && extra+=(--profile)
  for b in $BASELINE_SHAPES; do
    [ "$b" = "$shape" ] && extra+=(--baseline hf --baseline-max-seconds "$BASELINE_MAX_SECONDS")
  done
  say "bench $shape: $NUM_PROMPTS prompts x $INPUT_LEN in x $OUTPUT_LEN out ${extra[*]}"
  timeout "$BENCH_TIMEOUT" $PY -m pagoda.cli.main bench throughput --shape "$shape" --num-prompts "$NUM_PROMPTS" \
    --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos --json "$OUT/bench-$shape.json" "${extra[@]}" ${BENCH_ARGS:-} \
    2>&1 | grep -v -E "^(USDT|STAGE:)" | tee -a "$LOG"
  status=${PIPESTATUS[0]}
  [ "$status" = 0 ] || say "bench $shape failed or timed out (exit $status)"
done

# ------------------------------------------------------------------ summary
say "summary"
$PY - "$OUT" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
# /shared/BENCH_ANCHORS.md (one H200, 256 x 512 in x 256 out): vLLM 0.26.0 output tok/s and pagoda targets
ANCHORS = {"qwen3-0.6b": (33650, 38000), "phi3-mini": (6827, 10500), "qwen3-30b-a3b": (10492, 11500),
           "deepseek-v3-4l": (21440, 24500)}
rows = []
for path in sorted(out.glob("bench-*.json")):
    r = json.loads(path.read_text())
    shape = r["model"]["shape"] or r["model"]["path"]
    vllm, target = ANCHORS.get(shape, (None, None))
    best = r["best"]["output_tok_s"]
    base = (r.get("baseline") or {}).get("output_tok_s")
    rows.append({"shape": shape, "output_tok_s": best, "runs": [x["output_tok_s"] for x in r["runs"]],
                 "bound": r["roofline"]["bound_output_tok_s"], "fraction": r["fraction_of_bound"],
                 "vllm": vllm, "target": target, "hf": base})
(out / "summary.json").write_text(json.dumps(rows, indent=1))
print(f"{'shape':<16}{'pagoda tok/s':>14}{'bound':>10}{'of bound':>10}{'vLLM':>9}{'target':>9}{'met':>6}{'HF':>9}")
for x in rows:
    met = "" if x["target"] is None else ("yes" if x["output_tok_s"] >= x["target"] else "no")
    hf = f"{x['hf']:,.0f}" if x["hf"] else "-"
    vllm = f"{x['vllm']:,}" if x["vllm"] else "-"
    target = f"{x['target']:,}" if x["target"] else "-"
    print(f"{x['shape']:<16}{x['output_tok_s']:>14,.0f}{x['bound']:>10,.0f}{100 * x['fraction']:>9.1f}%"
          f"{vllm:>9}{target:>9}{met:>6}{hf:>9}")
EOF
say "done; results in $OUT"
