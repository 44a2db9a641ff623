#!/usr/bin/env bash
# The engine alone under a grammar on one CUDA GPU (issue 16): `pagoda bench throughput` on the qwen3-0.6b
# shape (dummy weights, SmolLM2's tokenizer as in gpu_structured.sh), 256 prompts x 64 in x 256 out at 64
# sequences, every request under the JSON schema of `bench serve --structured-outputs json`, sampled by
# py-spy: once with native frames (slow: the rate under it is not the engine's) and once Python-only
# (no measurable slowdown at 100 samples/s); then the same requests unconstrained, unprofiled.
# Results in $OUT (default out/offline-profile): offline-json.txt (native), offline-json-py.txt (py-spy's
# raw collapsed stacks; `python scripts/profile_summary.py FILE` summarises), log.
# Before the call: the .whl/ set-up of gpu_structured.sh and gpu_server_profile.sh (py-spy's wheel).
# Run (device tool, carry [".whl"]): bash scripts/gpu_offline_profile.sh     (about 2.5 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/offline-profile}
mkdir -p "$OUT"
export PY=python3 LOG=$OUT/log PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
say() { echo "$@" | tee -a "$LOG"; }
# shellcheck source=scripts/gpu_install.sh
. scripts/gpu_install.sh
$PY -m pip install -q --no-index --no-deps --target /tmp/py-spy .whl/py_spy-*.whl >>"$LOG" 2>&1
export PATH="/tmp/py-spy/bin:$PATH"
M=/tmp/pagoda-structured-qwen3
$PY scripts/structured_model.py "$M" 2>&1 | tee -a "$LOG"
B="$PY -m pagoda.cli.main bench throughput --model $M --load-format dummy --num-prompts 256 --input-len 64
   --output-len 256 --ignore-eos --repeats 2 --max-num-seqs 64"
# shellcheck disable=SC2086
{
  py-spy record -r 100 --native -f raw -o "$OUT/offline-json.txt" -- $B --structured-outputs json 2>&1
  py-spy record -r 100 -f raw -o "$OUT/offline-json-py.txt" -- $B --structured-outputs json 2>&1
  $B 2>&1
} | grep -E "output tok/s|rror" | tee -a "$LOG"
