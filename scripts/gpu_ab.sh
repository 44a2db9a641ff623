#!/usr/bin/env bash
# The working tree against an earlier commit on the same lent GPU, runs interleaved: did a change lose speed?
# Installs this tree into $SITE and the tree under $BASE_TREE (an export of the earlier commit) into
# $SITE_BASE, then runs each benchmark ROUNDS times per tree, alternating trees, and prints a table last
# (also in $OUT/summary.txt). Benchmarks: qwen3-0.6b throughput (the shared/BENCH_ANCHORS.md workload),
# decode latency at batch 1 and 8 (512 in, 128 out), and with STRUCTURED=1 issue 16's server ratio
# (scripts/gpu_structured.sh: xgrammar, 4 client processes, 2 pairs). About 4 minutes on an H100 with ROUNDS=2,
# throughput and batch 1 only; a structured round about 70 s a tree.
#
# Before the call, on the development machine:
#   mkdir -p .whl && cp /work/shared/gpu-wheels/*.whl .whl/            # once; .whl/ is git-ignored
#   rm -rf .ab && mkdir -p .ab/base && git archive BASE_COMMIT | tar -x -C .ab/base   # .ab/ is git-ignored
# Run (device tool, carry [".whl", ".ab"]): bash scripts/gpu_ab.sh
# Settings: ROUNDS=2 SHAPE=qwen3-0.6b THROUGHPUT=1 LATENCY_BATCHES="1 8" STRUCTURED=0 BENCH_TIMEOUT=240
#   BASE_TREE=.ab/base STRUCTURED_REPEATS=2 (and gpu_structured.sh's NUM_REQUESTS=256)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out/ab}
mkdir -p "$OUT"
LOG="$OUT/ab.log"
ROUNDS=${ROUNDS:-2}
SHAPE=${SHAPE:-qwen3-0.6b}
THROUGHPUT=${THROUGHPUT:-1}
LATENCY_BATCHES=${LATENCY_BATCHES-"1 8"}  # (empty: none)
BENCH_TIMEOUT=${BENCH_TIMEOUT:-240}
STRUCTURED=${STRUCTURED:-0}
STRUCTURED_REPEATS=${STRUCTURED_REPEATS:-2}  # interleaved pairs per structured run (NUM_REQUESTS: requests per run)
BASE_TREE=${BASE_TREE:-.ab/base}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
say() { echo "[ab +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

[ -f "$BASE_TREE/pyproject.toml" ] || { say "ERROR: no tree at $BASE_TREE (see the header)"; exit 1; }
# shellcheck source=scripts/gpu_install.sh
. scripts/gpu_install.sh  # this tree -> $SITE, on PYTHONPATH
SITE_BASE=${SITE_BASE:-/tmp/pagoda-site-base}
mkdir -p "$SITE_BASE"
cp -r "$SITE"/. "$SITE_BASE"/  # the carried wheels, then the base tree's pagoda over this tree's
BASE_PROJECTS="$BASE_TREE $(for d in "$BASE_TREE"/plugins/*/; do [ -f "$d/pyproject.toml" ] && printf '%s ' "$d"; done)"
# shellcheck disable=SC2086
$PY -m pip install -q --no-deps --no-build-isolation --no-index --no-compile --upgrade --target "$SITE_BASE" \
  $BASE_PROJECTS >>"$LOG" 2>&1 || { say "ERROR: installing the base tree failed"; tail -20 "$LOG"; exit 1; }
OTHER_PATH=${PYTHONPATH#"$SITE"}
tree_path() { if [ "$1" = base ]; then echo "$SITE_BASE$OTHER_PATH"; else echo "$SITE$OTHER_PATH"; fi; }

run_one() {  # tree name round
  local tree=$1 name=$2 round=$3 path
  path=$(tree_path "$tree")
  case $name in
    throughput)
      say "$tree: throughput $SHAPE, round $round"
      PYTHONPATH="$path" timeout "$BENCH_TIMEOUT" $PY -m pagoda.cli.main bench throughput --shape "$SHAPE" \
        --num-prompts 256 --input-len 512 --output-len 256 --ignore-eos \
        --json "$OUT/$tree-throughput-$round.json" >>"$LOG" 2>&1 || say "  failed (exit $?)" ;;
    latency-b*)
      local batch=${name#latency-b}
      say "$tree: latency $SHAPE batch $batch, round $round"
      PYTHONPATH="$path" timeout "$BENCH_TIMEOUT" $PY -m pagoda.cli.main bench latency --shape "$SHAPE" \
        --batch-size "$batch" --input-len 512 --output-len 128 --num-iters 3 --num-iters-warmup 1 \
        --max-num-seqs "$batch" --json "$OUT/$tree-$name-$round.json" >>"$LOG" 2>&1 || say "  failed (exit $?)" ;;
    structured)
      say "$tree: structured outputs through the server, round $round"
      PYTHONPATH="$path" SKIP_INSTALL=1 OUT="$OUT/structured-$tree-$round" BACKENDS=xgrammar OFFLINE=0 \
        CLIENT_PROCESSES=4 REPEATS=$STRUCTURED_REPEATS timeout $((BENCH_TIMEOUT + 60)) bash scripts/gpu_structured.sh \
        >>"$LOG" 2>&1
      cp "$OUT/structured-$tree-$round/bench-xgrammar-c4.json" "$OUT/$tree-structured-$round.json" 2>/dev/null \
        || say "  failed (see $OUT/structured-$tree-$round)" ;;
  esac
}

names=()
[ "$THROUGHPUT" = 1 ] && names+=(throughput)
for b in $LATENCY_BATCHES; do names+=("latency-b$b"); done
[ "$STRUCTURED" = 1 ] && names+=(structured)
for round in $(seq 1 "$ROUNDS"); do
  for name in "${names[@]}"; do
    if [ $((round % 2)) = 1 ]; then order="base tree"; else order="tree base"; fi
    for tree in $order; do run_one "$tree" "$name" "$round"; done
  done
done

$PY - "$OUT" <<'EOF' | tee "$OUT/summary.txt" | tee -a "$LOG"
import glob, json, os, sys
out = sys.argv[1]
rows = {}
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    tree, rest = os.path.basename(path)[:-5].split("-", 1)
    name, round_ = rest.rsplit("-", 1)
    data = json.load(open(path))
    if name == "throughput":
        value = round(data["best"]["output_tok_s"])  # output tok/s, best of the bench's runs
    elif name == "structured":  # JSON-schema tok/s / unconstrained tok/s (median of the pairs), mask ms/step,
        # and where the tree reports them: its wait for fills ahead, the device waits (unconstrained / JSON)
        mask = data.get("grammar_mask") or {}
        value = (data.get("ratio_to_unconstrained"), round(data["output_tokens_per_s"]),
                 round(data["unconstrained"]["output_tokens_per_s"]), mask.get("ms_per_step"))
        if "engine" in data:
            value += (mask.get("fill_wait_ms_per_step"), data["unconstrained"]["engine"]["device_wait_ms_per_step"],
                      data["engine"]["device_wait_ms_per_step"])
    else:
        value = round(data["requests_ms"]["itl"]["p50"], 3)  # p50 inter-token latency, ms
    rows.setdefault(name, {}).setdefault(tree, []).append(value)
print("| benchmark (throughput: output tok/s; latency: p50 ITL ms; structured: ratio, JSON tok/s, plain tok/s, mask ms/step[, fill wait, device wait plain / JSON ms/step]) | base (each round) | this tree (each round) |")
print("| --- | --- | --- |")
for name, trees in rows.items():
    print(f"| {name} | {trees.get('base')} | {trees.get('tree')} |")
EOF
say "done"
