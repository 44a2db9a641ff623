#!/usr/bin/env bash
# The GPU check of the architectures of issue 18 (Gemma 2/3, Mixtral, GPT-OSS, DeepSeek-V3.2) on one
# lent H200 (nvidia-h200), each section under a timeout. Results go to $OUT (default out/arch):
#   arch.log                 everything printed (the sparse-MLA timings are its "sparse MLA decode layer" lines)
#   kernels-arch.json        python -m pagoda_cuda.kernel_bench --only sparse-mla rows
#   bench-<shape>.json       pagoda bench throughput for gemma3-1b and gpt-oss-20b (docs/benchmarks.md format)
#   summary.json             the benchmark table
#
# Before the call, on the development machine (once), as for gpu_check.sh:
#   mkdir -p .whl && cp /work/shared/gpu-wheels/*.whl .whl/     # .whl/ is git-ignored; carry it
# Run (device tool, kind nvidia-h200, carry [".whl"]):   bash scripts/gpu_arch_check.sh
# Settings (environment variables):
#   SECTIONS="tests models kernels bench"   what to run
#   SHAPES="gemma3-1b gpt-oss-20b"  NUM_PROMPTS=256 INPUT_LEN=512 OUTPUT_LEN=256   the benchmarks
#   TEST_TIMEOUT=300 MODEL_TIMEOUT=300 KERNEL_TIMEOUT=150 BENCH_TIMEOUT=300       seconds per section / shape
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/arch}
mkdir -p "$OUT"
LOG="$OUT/arch.log"
SECTIONS=${SECTIONS:-"tests models kernels bench"}
SHAPES=${SHAPES:-"gemma3-1b gpt-oss-20b"}
NUM_PROMPTS=${NUM_PROMPTS:-256}
INPUT_LEN=${INPUT_LEN:-512}
OUTPUT_LEN=${OUTPUT_LEN:-256}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
MODEL_TIMEOUT=${MODEL_TIMEOUT:-300}
KERNEL_TIMEOUT=${KERNEL_TIMEOUT:-150}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-300}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
say() { echo "[arch +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
has() { [[ " $SECTIONS " == *" $1 "* ]]; }

# shellcheck source=scripts/gpu_install.sh
. scripts/gpu_install.sh
$PY -c "import torch, pagoda; print('torch', torch.__version__, '| pagoda', pagoda.__version__, '|',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda')" 2>&1 | tee -a "$LOG"

if has tests; then
  # the new kernels at real shapes: attention sinks and windows (GPT-OSS, Gemma 3), the offset norms,
  # GPT-OSS's biased experts, DeepSeek-V3.2's sparse MLA against the torch reference and its decode timing
  say "gpu-marked kernel tests (new architectures)"
  timeout "$TEST_TIMEOUT" $PY -m pytest -q -s -m gpu -rfEs --timeout 240 -p no:cacheprovider \
    plugins/cuda/tests/test_sparse_mla.py plugins/cuda/tests/test_attention.py plugins/cuda/tests/test_ops.py \
    -k "sparse or sinks or gemma3 or offset or gpt_oss" 2>&1 | tee -a "$LOG" | grep -E "sparse MLA|passed|failed|error" \
    | tail -12
  say "kernel tests done (exit ${PIPESTATUS[0]})"
fi
if has models; then
  # tiny Gemma 3, GPT-OSS and DeepSeek-V3.2 against transformers through the Triton kernels, eager then graphs
  say "tiny models through the Triton kernels on the GPU"
  timeout "$MODEL_TIMEOUT" $PY -m pytest -q -rfEs --timeout 240 -p no:cacheprovider \
    plugins/cuda/tests/test_model_triton.py -k "gemma3 or gpt_oss or v32" 2>&1 | tee -a "$LOG" | tail -8
  say "model checks done (exit ${PIPESTATUS[0]})"
fi
if has kernels; then
  say "sparse MLA kernel timings (DeepSeek-V3.2 decode shapes)"
  timeout "$KERNEL_TIMEOUT" $PY -m pagoda_cuda.kernel_bench --only sparse-mla --json "$OUT/kernels-arch.json" 2>&1 \
    | tee -a "$LOG"
fi
if has bench; then
  for shape in $SHAPES; do
    say "bench $shape: $NUM_PROMPTS prompts x $INPUT_LEN in x $OUTPUT_LEN out --profile"
    timeout "$BENCH_TIMEOUT" $PY -m pagoda.cli.main bench throughput --shape "$shape" --num-prompts "$NUM_PROMPTS" \
      --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos --profile --json "$OUT/bench-$shape.json" \
      2>&1 | grep -v -E "^(USDT|STAGE:)" | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" = 0 ] || say "bench $shape failed or timed out"
  done
  $PY - "$OUT" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = []
for path in sorted(out.glob("bench-*.json")):
    r = json.loads(path.read_text())
    rows.append({"shape": r["model"]["shape"], "output_tok_s": r["best"]["output_tok_s"],
                 "runs": [x["output_tok_s"] for x in r["runs"]], "bound": r["roofline"]["bound_output_tok_s"],
                 "fraction": r["fraction_of_bound"], "kv_bytes_per_token": r["model"]["kv_bytes_per_token"],
                 "graphs": r["model"]["cuda_graphs"]})
(out / "summary.json").write_text(json.dumps(rows, indent=1))
for x in rows:
    print(f"{x['shape']:<14} {x['output_tok_s']:>10,.0f} tok/s  bound {x['bound']:>10,.0f}  "
          f"{100 * x['fraction']:.1f}%  runs {[round(v) for v in x['runs']]}")
EOF
fi
say "done; results in $OUT"
