#!/usr/bin/env bash
# GPU check of the pooling runner (issue 21, docs/pooling.md), within 4 minutes on one H200:
#   1. correctness: qwen3-0.6b shape in float32, transformers' random weights loaded by both engines,
#      32 prompts x 512 tokens: pagoda's embeddings against HF's (min cosine; > 0.9999 expected)
#   2. throughput: qwen3-0.6b shape in bfloat16, 1024 prompts x 512 tokens, last-token pooling, normalized:
#      pagoda's embeddings/s against HF transformers (batches of 32, no padding) in the same call
# Results: $OUT/pooling.log, $OUT/embed-check.json, $OUT/embed-bench.json; a short table last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/pooling}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
LOG="$OUT/pooling.log"
T0=$(date +%s)
say() { echo "[pooling +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
# shellcheck source=scripts/gpu_install.sh
. scripts/gpu_install.sh

embed() {  # name, timeout, args...
  local name=$1 limit=$2
  shift 2
  say "bench embed $name: $*"
  timeout "$limit" $PY -m pagoda.cli.main bench embed --shape qwen3-0.6b --input-len 512 --baseline hf \
    --json "$OUT/embed-$name.json" "$@" >"$OUT/embed-$name.txt" 2>&1 || say "embed $name failed or timed out"
  tail -4 "$OUT/embed-$name.txt" | tee -a "$LOG"
}

embed check 90 --dtype float32 --num-prompts 32 --repeats 1 --check-prompts 32
embed bench 120 --dtype bfloat16 --num-prompts 1024 --repeats 2 --check-prompts 16 --baseline-max-seconds 40
say "done"
$PY - "$OUT" <<'PYEOF' | tee -a "$LOG"
import json, sys
from pathlib import Path
print(f"{'run':<7}{'dtype':<10}{'pagoda emb/s':>14}{'HF emb/s':>12}{'speedup':>9}{'min cos':>10}")
for name in ("check", "bench"):
    path = Path(sys.argv[1]) / f"embed-{name}.json"
    if not path.exists():
        print(f"{name:<7}(no result)")
        continue
    r = json.loads(path.read_text())
    base = r.get("baseline") or {}
    print(f"{name:<7}{r['dtype']:<10}{r['pagoda']['embeddings_per_s']:>14.1f}{base.get('embeddings_per_s', 0):>12.1f}"
          f"{r.get('speedup_vs_hf', 0):>9.2f}{r.get('check', {}).get('min_cosine', float('nan')):>10.6f}")
PYEOF
