#!/usr/bin/env bash
# Structured outputs on one CUDA GPU (nvidia-h200), issue 16's benchmark: `pagoda serve` with a
# random-weight Qwen3-0.6B shape, driven by `pagoda bench serve --concurrency 64`, first unconstrained and
# then with every request under the same JSON schema (xgrammar); prints the output tok/s ratio and the
# grammar masks' host cost per engine step. Results go to $OUT (default out/structured): structured.log,
# bench-<backend>.json.
#
# The shape has no tokenizer of its own and the GPU machine has no hub access: the tokenizer is
# SmolLM2's (49,152 tokens, built from the embedded GGUF), carried in .whl/smollm2-tokenizer; the model's
# vocabulary (151,936) is larger, so the masks also cover a padded vocabulary. Before the call, on the
# development machine:
#   mkdir -p .whl && cp /work/shared/gpu-wheels/*.whl .whl/     # plus xgrammar, apache-tvm-ffi, llguidance
#   (and, for the GPU tests of tests/test_structured_outputs.py, jsonschema: see gpu_check.sh's header)
#   python -c "from pagoda.loader.source import default_model_path as p; from pagoda.loader.gguf_file import \
#     open_gguf; open_gguf(p()).tokenizer().hf.save_pretrained('.whl/smollm2-tokenizer')"
# Run (device tool, carry [".whl"]): bash scripts/gpu_structured.sh     (about 3 minutes)
# Settings: BACKENDS="xgrammar llguidance" CONCURRENCY=64 NUM_REQUESTS=256 MAX_TOKENS=256 PROMPT_LEN=64
#   WARMUPS=CONCURRENCY (untimed requests of each mode before the pairs: the first constrained run had been the slowest)
#   REPEATS=3 (interleaved unconstrained/constrained pairs; the ratio is their median: one pair varies by 0.1-0.2)
#   SERVE_ARGS="" (extra arguments of pagoda serve, e.g. --no-async-scheduling)
#   ENGINE_PROCESS="1" (1: the engine in its own process, pagoda serve's default; 0: on a thread of the server,
#   --no-engine-process; "0 1": one server each, in that order, results bench-<backend>-c<N>[-thread].json)
#   CLIENT_PROCESSES="1" (bench serve --client-processes; several values: one bench each, bench-<backend>-c<N>.json)
#   SKIP_INSTALL=1 (use the pagoda already importable; scripts/gpu_ab.sh sets it)
#   OFFLINE=1 (first the engine alone: pagoda bench throughput, unconstrained and --structured-outputs json,
#   at the same concurrency; offline-*.json)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/structured}
mkdir -p "$OUT"
LOG="$OUT/structured.log"
BACKENDS=${BACKENDS-"xgrammar llguidance"}  # (empty: the offline part only)
CONCURRENCY=${CONCURRENCY:-64}
NUM_REQUESTS=${NUM_REQUESTS:-256}
MAX_TOKENS=${MAX_TOKENS:-256}
PROMPT_LEN=${PROMPT_LEN:-64}
REPEATS=${REPEATS:-3}
WARMUPS=${WARMUPS:-$CONCURRENCY}  # untimed requests of each mode first (bench serve --num-warmups)
PORT=${PORT:-8123}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
say() { echo "[structured +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

if [ "${SKIP_INSTALL:-0}" != 1 ]; then  # (1: the pagoda already importable, e.g. gpu_ab.sh's trees)
  # shellcheck source=scripts/gpu_install.sh
  . scripts/gpu_install.sh
fi
MODEL=/tmp/pagoda-structured-qwen3
$PY scripts/structured_model.py "$MODEL" 2>&1 | tee -a "$LOG"
if [ "${OFFLINE:-1}" = 1 ]; then  # the engine alone (LLM.generate), same requests: unconstrained, then constrained
  for so in "" json; do
    say "offline: pagoda bench throughput ${so:+--structured-outputs $so}"
    timeout 240 $PY -m pagoda.cli.main bench throughput --model "$MODEL" --load-format dummy --num-prompts \
      "$NUM_REQUESTS" --input-len "$PROMPT_LEN" --output-len "$MAX_TOKENS" --ignore-eos --repeats 2 \
      --max-num-seqs "$CONCURRENCY" ${so:+--structured-outputs $so} --json "$OUT/offline-${so:-none}.json" \
      2>&1 | grep -E "output tok/s|error|Error" | tee -a "$LOG"
  done
fi
for backend in $BACKENDS; do
  for process in ${ENGINE_PROCESS:-1}; do
    suffix="-thread"; flag="--no-engine-process"
    [ "$process" = 1 ] && suffix="" && flag="--engine-process"
    say "serve qwen3-0.6b shape (dummy weights), structured_outputs_backend=$backend ${flag}"
    # shellcheck disable=SC2086
    $PY -m pagoda.cli.main serve --model "$MODEL" --load-format dummy --port "$PORT" --max-num-seqs 128 \
      --structured-outputs-backend "$backend" $flag ${SERVE_ARGS:-} >>"$LOG" 2>&1 &
    SERVER=$!
    for _ in $(seq 1 120); do
      curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
      kill -0 $SERVER 2>/dev/null || break
      sleep 1
    done
    say "server up (pid $SERVER); bench: $NUM_REQUESTS requests, concurrency $CONCURRENCY, $MAX_TOKENS tokens"
    for clients in ${CLIENT_PROCESSES:-1}; do
      timeout 240 $PY -m pagoda.cli.main bench serve --url "http://127.0.0.1:$PORT" --concurrency "$CONCURRENCY" \
        --num-requests "$NUM_REQUESTS" --max-tokens "$MAX_TOKENS" --prompt-len "$PROMPT_LEN" \
        --structured-outputs json --compare-unconstrained --repeats "$REPEATS" --client-processes "$clients" \
        --num-warmups "$WARMUPS" \
        --json > "$OUT/bench-$backend-c$clients$suffix.json" 2>>"$LOG"
      say "bench ($clients client processes${flag:+, $flag}) exit $?"
    done
    curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^pagoda_engine_(steps|mixed_steps_replayed)_total" >>"$LOG"
    kill $SERVER; wait $SERVER 2>/dev/null
  done
done
$PY - "$OUT" <<'PYEOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
try:
    plain, so = (json.loads((out / f"offline-{k}.json").read_text())["best"] for k in ("none", "json"))
    mask = so.get("grammar_mask") or {}
    print(f"offline (LLM.generate): unconstrained {plain['output_tok_s']:.0f} tok/s, JSON schema "
          f"{so['output_tok_s']:.0f} tok/s, ratio {so['output_tok_s'] / plain['output_tok_s']:.3f}; steps launched "
          f"ahead {so['steps_launched_ahead']}; mask {mask.get('mask_ms_per_step', 0):.3f} ms/step (cumulative)")
except (OSError, ValueError, KeyError) as exc:
    print("offline: none", exc)
print("| backend, client processes | unconstrained tok/s | JSON-schema tok/s | ratio (median) | pair ratios | mask ms/step (waiting for fills) | mask us/row | mask share | steps launched ahead | device wait ms/step (unconstrained / JSON) | client CPU share (unconstrained / JSON) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for path in sorted(Path(sys.argv[1]).glob("bench-*.json")):
    try:
        r = json.loads(path.read_text())
    except ValueError:
        print(f"| {path.stem[6:]} | failed (see structured.log) |"); continue
    m = r.get("grammar_mask") or {}
    print(f"| {path.stem[6:]} | {r['unconstrained']['output_tokens_per_s']} | {r['output_tokens_per_s']} | "
          f"{r.get('ratio_to_unconstrained')} | {r.get('pair_ratios')} | {m.get('ms_per_step')} "
          f"({m.get('fill_wait_ms_per_step')}) | {m.get('us_per_row')} | {m.get('share_of_wall')} | "
          f"{m.get('steps_launched_ahead')} / {m.get('engine_steps')} | "
          f"{(r['unconstrained'].get('engine') or {}).get('device_wait_ms_per_step')} / "
          f"{(r.get('engine') or {}).get('device_wait_ms_per_step')} | "
          f"{r['unconstrained'].get('client_cpu_share')} / {r.get('client_cpu_share')} |")
PYEOF
