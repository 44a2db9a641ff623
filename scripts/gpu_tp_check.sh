#!/usr/bin/env bash
# The tensor/expert-parallel GPU check, for a 2-GPU machine (device kind nvidia-h200-x2):
#   1. equality: TP=2 (and EP=2) greedy tokens == TP=1 on random models with real layer widths
#      (scripts/gpu_tp_check.py: Qwen3-0.6B shape x 4 layers, Qwen3-30B-A3B shape x 2 layers)
#   2. bench: pagoda bench throughput --shape qwen3-30b-a3b at TP=1, TP=2, EP=2, and EP=2 with
#      the balanced expert placement EP=2 computed from its own expert load
# then a summary with the scaling efficiency (tok/s at 2 GPUs / (2 x tok/s at 1 GPU)) and the
# expert balance, and markdown rows for docs/benchmarks.md. Results go to $OUT (default out/gpu-tp):
#   gpu_tp_check.log          everything printed
#   equality.json             scripts/gpu_tp_check.py rows
#   bench-<mode>.json         pagoda bench throughput results (modes: tp1 tp2 ep2 ep2-balanced)
#   expert-placement.json     the balanced placement EP=2 wrote (input of ep2-balanced)
#   summary.json              the final table
#
# Install: like scripts/gpu_check.sh (carried wheels in .whl/, pagoda and plugins from the tree).
# Settings (environment variables):
#   SECTIONS="equality bench"  MODES="tp1 tp2 ep2 ep2-balanced"  SHAPE=qwen3-30b-a3b
#   NUM_PROMPTS=256 INPUT_LEN=512 OUTPUT_LEN=256                 the workload (BENCH_ANCHORS.md)
#   EQUALITY_SHAPES="qwen3-0.6b:4,qwen3-30b-a3b:2"  EQUALITY_DTYPES="float32,bfloat16"
#   EQUALITY_TIMEOUT=540 BENCH_TIMEOUT=420                        seconds per section / per mode
# Each section fits one 10-minute call: e.g. SECTIONS=equality, then SECTIONS=bench MODES="tp1 tp2",
# then SECTIONS=bench MODES="ep2 ep2-balanced" (the summary reads whatever JSON is in $OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/gpu-tp}
mkdir -p "$OUT"
LOG="$OUT/gpu_tp_check.log"
SECTIONS=${SECTIONS:-"equality bench"}
MODES=${MODES:-"tp1 tp2 ep2 ep2-balanced"}
SHAPE=${SHAPE:-qwen3-30b-a3b}
NUM_PROMPTS=${NUM_PROMPTS:-256}
INPUT_LEN=${INPUT_LEN:-512}
OUTPUT_LEN=${OUTPUT_LEN:-256}
EQUALITY_SHAPES=${EQUALITY_SHAPES:-"qwen3-0.6b:4,qwen3-30b-a3b:2"}
EQUALITY_DTYPES=${EQUALITY_DTYPES:-"float32,bfloat16"}
EQUALITY_TIMEOUT=${EQUALITY_TIMEOUT:-540}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-420}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off on the lent machines (it can take shared GPUs out of service); the
# worker processes pagoda starts inherit these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s)

say() { echo "[gpu_tp_check +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

# ------------------------------------------------------------------ install
# shellcheck source=scripts/gpu_install.sh
. scripts/gpu_install.sh
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv 2>&1 | tee -a "$LOG"
nvidia-smi topo -m >>"$LOG" 2>&1

# ------------------------------------------------------------------ equality
if [[ " $SECTIONS " == *" equality "* ]]; then
  say "equality: $EQUALITY_SHAPES in $EQUALITY_DTYPES"
  timeout "$EQUALITY_TIMEOUT" $PY scripts/gpu_tp_check.py --out "$OUT" --shapes "$EQUALITY_SHAPES" \
    --dtypes "$EQUALITY_DTYPES" 2>&1 | grep -v -E "^(USDT|STAGE:)" | tee -a "$LOG"
  say "equality done (exit ${PIPESTATUS[0]})"
fi

# ------------------------------------------------------------------ benchmarks
if [[ " $SECTIONS " == *" bench "* ]]; then
  for mode in $MODES; do
    case "$mode" in
      tp1) flags=() ;;
      tp2) flags=(--tensor-parallel-size 2) ;;
      ep2) flags=(--tensor-parallel-size 2 --enable-expert-parallel --save-expert-placement "$OUT/expert-placement.json") ;;
      ep2-balanced)
        if [ ! -f "$OUT/expert-placement.json" ]; then say "SKIP ep2-balanced: run ep2 first"; continue; fi
        flags=(--tensor-parallel-size 2 --enable-expert-parallel --expert-placement "$OUT/expert-placement.json") ;;
      *) say "unknown mode $mode"; continue ;;
    esac
    say "bench $SHAPE $mode: $NUM_PROMPTS prompts x $INPUT_LEN in x $OUTPUT_LEN out ${flags[*]}"
    timeout "$BENCH_TIMEOUT" $PY -m pagoda.cli.main bench throughput --shape "$SHAPE" --num-prompts "$NUM_PROMPTS" \
      --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos --json "$OUT/bench-$mode.json" "${flags[@]}" \
      2>&1 | grep -v -E "^(USDT|STAGE:)" | tee -a "$LOG"
    status=${PIPESTATUS[0]}
    [ "$status" = 0 ] || say "bench $mode failed or timed out (exit $status)"
  done
fi

# ------------------------------------------------------------------ summary
say "summary"
$PY - "$OUT" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {}
for mode in ("tp1", "tp2", "ep2", "ep2-balanced"):
    path = out / f"bench-{mode}.json"
    if path.is_file():
        r = json.loads(path.read_text())
        rows[mode] = {"output_tok_s": r["best"]["output_tok_s"], "runs": [x["output_tok_s"] for x in r["runs"]],
                      "gpus": r["engine_config"]["tensor_parallel_size"], "expert_balance": r.get("expert_balance"),
                      "expert_placement": r["engine_config"].get("expert_placement")}
one = rows.get("tp1", {}).get("output_tok_s")
for row in rows.values():
    row["scaling_efficiency"] = row["output_tok_s"] / (row["gpus"] * one) if one else None
equality = json.loads((out / "equality.json").read_text()) if (out / "equality.json").is_file() else []
(out / "summary.json").write_text(json.dumps({"bench": rows, "equality": equality}, indent=1))
for e in equality:
    print(f"equality {e['shape']} x{e['layers']} {e['dtype']:9s} {e['mode']}: {e['prompts_equal']}/{e['prompts']} "
          f"prompts equal to tp1, mean common prefix {e['mean_common_prefix']:.1f}/{e['max_tokens']}")
print(f"{'mode':<14}{'GPUs':>5}{'output tok/s':>14}{'scaling eff.':>14}{'busiest/mean before -> after':>32}")
for mode, x in rows.items():
    eff = f"{100 * x['scaling_efficiency']:.0f}%" if x["scaling_efficiency"] else "-"
    b = x["expert_balance"]
    bal = f"{b['before']:.3f} -> {b['after']:.3f}" if b else "-"
    print(f"{mode:<14}{x['gpus']:>5}{x['output_tok_s']:>14,.0f}{eff:>14}{bal:>32}")
print("\nmarkdown rows for docs/benchmarks.md:")
print("| mode | GPUs | output tok/s | scaling efficiency | expert balance (busiest rank / mean) |")
print("| --- | --- | --- | --- | --- |")
for mode, x in rows.items():
    eff = f"{100 * x['scaling_efficiency']:.0f}%" if x["scaling_efficiency"] else "-"
    b = x["expert_balance"]
    bal = f"{b['before']:.3f} ({b['current']}) -> {b['after']:.3f} balanced" if b else "-"
    print(f"| {mode} | {x['gpus']} | {x['output_tok_s']:,.0f} | {eff} | {bal} |")
EOF
say "done; results in $OUT"
