#!/usr/bin/env bash
# Pipeline and data parallelism on a 2-GPU machine (device kind nvidia-h200-x2: it needs two GPUs).
#   1. equality: PP=2 and DP=2 greedy tokens == one GPU on a random Qwen3-30B-A3B-shaped model with
#      4 layers (float32; dummy weights, token ids in and out)
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
  say "equality: PP=2 and DP=2 against one GPU ($SHAPE x 4 layers, float32)"
  timeout 240 $PY - "$SHAPE" <<'PYEOF' 2>&1 | grep -v -E "^(USDT|STAGE:)" | tee -a "$LOG" "$OUT/equality.txt"
import json, sys, tempfile
from pathlib import Path
from pagoda import LLM, SamplingParams
from pagoda.bench.shapes import write_shape
shape = sys.argv[1]
tmp = Path(tempfile.mkdtemp())
path = write_shape(shape, tmp / shape)
cfg = json.loads((path / "config.json").read_text()); cfg["num_hidden_layers"] = 4
(path / "config.json").write_text(json.dumps(cfg))
common = dict(model=str(path), load_format="dummy", skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              max_num_seqs=16, enforce_eager=True)
import numpy as np
prompts = np.random.default_rng(0).integers(100, 30000, size=(8, 64)).tolist()
params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False)
def run(**kw):
    llm = LLM(**common, **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
ref = run()
for name, kw in (("pp2", dict(pipeline_parallel_size=2)), ("dp2", dict(data_parallel_size=2))):
    got = run(**kw)
    same = sum(a == b for a, b in zip(got, ref))
    print(f"EQUALITY {name}: {same}/{len(ref)} prompts equal to one GPU")
PYEOF
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
    if line.startswith("EQUALITY"):
        print(line)
PYEOF
