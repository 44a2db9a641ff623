#!/usr/bin/env bash
# Where `pagoda serve` spends its host time on one CUDA GPU (issue 16: the server is host-bound): the
# benchmark of gpu_structured.sh (qwen3-0.6b shape, dummy weights, SmolLM2's tokenizer, 64 concurrent
# streamed requests), once unconstrained and once under a JSON schema, each with the server and the
# benchmark client sampled by py-spy (carried as a wheel in .whl/). Prints, per run, the output tok/s, the
# client's CPU time over the wall time (near 1.0 the client is the bottleneck, not the server) and each
# process's heaviest functions per thread (scripts/profile_summary.py).
# Results in $OUT (default out/server-profile): <mode>-server.txt / <mode>-client.txt (py-spy's raw
# collapsed stacks), <mode>-bench.json, profile.log.
# Before the call: the .whl/ set-up of gpu_structured.sh, plus
#   pip download --no-deps --only-binary=:all: --platform manylinux2014_x86_64 -d .whl py-spy
# Run (device tool, carry [".whl"]): bash scripts/gpu_server_profile.sh     (about 3 minutes)
# Settings: NUM_REQUESTS=256 CONCURRENCY=64 MAX_TOKENS=256 PROMPT_LEN=64 MODES="none json" RATE=200 (samples/s)
#   SERVE_ARGS="" (extra arguments of pagoda serve)
#   SPY_ARGS="--subprocesses" (py-spy's arguments: the engine runs in its own process, which py-spy follows only
#   with --subprocesses; add e.g. --gil: only the thread holding the GIL is sampled)
#   CLIENT_PROCESSES=1 (bench serve --client-processes; py-spy follows the first)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/server-profile}
mkdir -p "$OUT"
LOG="$OUT/profile.log"
NUM_REQUESTS=${NUM_REQUESTS:-256}
CONCURRENCY=${CONCURRENCY:-64}
MAX_TOKENS=${MAX_TOKENS:-256}
PROMPT_LEN=${PROMPT_LEN:-64}
RATE=${RATE:-200}
PORT=${PORT:-8124}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
say() { echo "[profile +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

# shellcheck source=scripts/gpu_install.sh
. scripts/gpu_install.sh
# (pip --target replaces bin/ when pagoda's own scripts are installed after the wheels: py-spy gets its own)
$PY -m pip install -q --no-index --no-deps --target /tmp/py-spy .whl/py_spy-*.whl >>"$LOG" 2>&1
export PATH="/tmp/py-spy/bin:$PATH"
command -v py-spy >/dev/null || { say "ERROR: py-spy is not installed (add its wheel to .whl/)"; exit 1; }
MODEL=/tmp/pagoda-structured-qwen3
$PY scripts/structured_model.py "$MODEL" 2>&1 | tee -a "$LOG"
# py-spy attaches to the running server for the measured round only (start-up left out) where ptrace of a
# non-child is allowed; else it launches the server and its profile includes the start-up.
$PY -c "import time; time.sleep(20)" & PROBE=$!
sleep 1
if py-spy dump --pid $PROBE >/dev/null 2>&1; then ATTACH=1; else ATTACH=0; fi
kill $PROBE 2>/dev/null
say "py-spy attaches to a running server: $ATTACH"
for mode in ${MODES:-none json}; do
  say "serve ($mode)"
  SPY=()
  [ "$ATTACH" = 1 ] || SPY=(py-spy record -r "$RATE" -f raw -o "$OUT/$mode-server.txt" --threads ${SPY_ARGS---subprocesses} --)
  # shellcheck disable=SC2086
  "${SPY[@]}" $PY -m pagoda.cli.main serve --model "$MODEL" --load-format dummy --port "$PORT" \
    --max-num-seqs 128 ${SERVE_ARGS:-} >>"$LOG" 2>&1 &
  for _ in $(seq 1 180); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    sleep 1
  done
  SERVER=$(pgrep -f "pagoda.cli.main serve --model $MODEL" | tail -1)
  so=(); [ "$mode" = none ] || so=(--structured-outputs "$mode")
  say "bench serve ($mode): $NUM_REQUESTS requests, concurrency $CONCURRENCY (server pid $SERVER)"
  # a first round warms the grammar cache and the server's code paths; the second is the one measured
  $PY -m pagoda.cli.main bench serve --url "http://127.0.0.1:$PORT" --concurrency "$CONCURRENCY" \
    --num-requests "$CONCURRENCY" --max-tokens 16 --prompt-len "$PROMPT_LEN" "${so[@]}" >/dev/null 2>>"$LOG"
  if [ "$ATTACH" = 1 ]; then
    py-spy record -r "$RATE" -f raw -o "$OUT/$mode-server.txt" --threads ${SPY_ARGS---subprocesses} --pid "$SERVER" >>"$LOG" 2>&1 &
    sleep 1
  fi
  py-spy record -r "$RATE" -f raw -o "$OUT/$mode-client.txt" -- $PY -m pagoda.cli.main bench serve \
    --url "http://127.0.0.1:$PORT" --concurrency "$CONCURRENCY" --num-requests "$NUM_REQUESTS" \
    --max-tokens "$MAX_TOKENS" --prompt-len "$PROMPT_LEN" "${so[@]}" --client-processes "${CLIENT_PROCESSES:-1}" \
    --json | grep -v "^py-spy>" > "$OUT/$mode-bench.json" 2>>"$LOG"
  $PY -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2] + ':', r['output_tokens_per_s'], \
    'output tok/s; client CPU share', r['client_cpu_share'], '; mask', r.get('grammar_mask'))" \
    "$OUT/$mode-bench.json" "$mode" 2>&1 | tee -a "$LOG"
  kill -INT "$SERVER"
  wait 2>/dev/null
  sleep 1
done
$PY scripts/profile_summary.py "$OUT"/*-server.txt "$OUT"/*-client.txt 2>&1 | tee -a "$LOG"
