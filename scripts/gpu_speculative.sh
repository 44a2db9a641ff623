#!/usr/bin/env bash
# Speculative decoding on one CUDA GPU (docs/speculative.md), in about 4 minutes:
#  1. correctness: a tiny random llama, float32, greedy outputs with n-gram and draft-model speculation
#     identical to plain decoding, with verification replayed from the decode graphs;
#  2. latency: `pagoda bench latency` on a qwen3-0.6b-shaped random checkpoint (written once, so the
#     draft can load the very same weights), batch 1 and 8, without speculation, with the model drafting
#     for itself (acceptance high by construction: the machinery's ceiling), and n-gram prompt lookup on
#     repetitive prompts (--prompt-period 8; its plain baseline is the plain row: the prompt's content does
#     not change plain decoding's speed);
#  3. MTP: deepseek-v3-4l with random weights (load_format dummy, MTP layer included), batch 1, with and
#     without method mtp (random weights: acceptance near zero; this measures the cost of the machinery);
#  4. EAGLE-3: a random head on the qwen3-0.6b checkpoint, batch 1 and 8 (method eagle3; acceptance near
#     zero: the machinery's cost against the plain rows).
# Results go to $OUT (default out/spec): spec.log, lat-*.json (format: pagoda.bench.latency/1), summary.txt.
#   SPEC_K=4  INPUT_LEN=128  OUTPUT_LEN=96  ITERS=2  RUN_TIMEOUT=45  MTP=1  EAGLE3=1   settings
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/spec}
mkdir -p "$OUT"
LOG="$OUT/spec.log"
PY=${PYTHON:-python3}
SPEC_K=${SPEC_K:-4}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-96}
ITERS=${ITERS:-2}
RUN_TIMEOUT=${RUN_TIMEOUT:-45}
MTP=${MTP:-1}
EAGLE3=${EAGLE3:-1}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
say() { echo "[spec +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

# shellcheck source=scripts/gpu_install.sh
. scripts/gpu_install.sh

say "correctness: greedy with speculation == plain decoding (tiny llama, float32, CUDA graphs on)"
timeout 90 $PY - <<'PYEOF' 2>&1 | tee -a "$LOG" | grep -E "^(OK|FAIL)"
import tempfile
from pagoda import LLM, SamplingParams
from pagoda.testing import make_tiny_checkpoint, random_prompts
from pagoda.testing.eagle3 import make_eagle3_head

d = tempfile.mkdtemp()
make_tiny_checkpoint("llama", d, seed=3, vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
prompts = random_prompts(6, 260, 5, 40, seed=1)
prompts[0] = (prompts[0][:5] * 8)[:40]
params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
common = dict(device="cuda", dtype="float32", max_num_seqs=8, num_kv_blocks=256)
want = [o.outputs[0].token_ids for o in LLM(model=d, **common).generate(prompts, params)]
head = make_eagle3_head(tempfile.mkdtemp(), 260, 64, 96, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]})
for spec in ({"method": "ngram", "num_speculative_tokens": 4},
             {"method": "draft_model", "model": d, "num_speculative_tokens": 4},
             {"method": "eagle3", "model": head, "num_speculative_tokens": 4}):
    llm = LLM(model=d, speculative_config=spec, **common)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    s, dec = llm.get_stats()["speculative"], llm.engine.speculative
    # (eagle3 reads the target's hidden states after every step: its verifications run as chunks, eagerly)
    ok = got == want and s["draft_tokens"] > 0 and (dec.verified_as_decodes > 0 or spec["method"] == "eagle3")
    print("OK" if ok else "FAIL", spec["method"], "identical" if got == want else "DIFFERENT",
          f"acceptance {s['acceptance_rate']:.2f}, verifications: {dec.verified_as_decodes} graph/decode rows, "
          f"{dec.verified_as_chunks} chunks")
PYEOF

CKPT=/tmp/spec-qwen3-0.6b
say "writing a random qwen3-0.6b checkpoint to $CKPT (bf16)"
timeout 120 $PY - "$CKPT" <<'PYEOF' 2>&1 | tail -2 | tee -a "$LOG"
import sys, torch
from transformers import AutoModelForCausalLM
from pagoda.bench.shapes import shape_config
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(shape_config("qwen3-0.6b"), dtype=torch.bfloat16)
model.save_pretrained(sys.argv[1])
print("saved", sys.argv[1])
PYEOF

HEAD=/tmp/spec-qwen3-0.6b-eagle3
say "writing a random EAGLE-3 head for it to $HEAD (draft vocabulary: the first 32000 ids)"
timeout 120 $PY -c "import torch; from pagoda.testing.eagle3 import make_eagle3_head as m; \
m('$HEAD', 151936, 1024, 3072, torch.arange(32000), num_attention_heads=16, num_key_value_heads=8, head_dim=128)" \
  >>"$LOG" 2>&1 || say "writing the EAGLE-3 head failed"

lat() {  # name, batch, extra args...
  local name=$1 batch=$2
  shift 2
  say "latency $name (batch $batch)"
  timeout "$RUN_TIMEOUT" $PY -m pagoda.cli.main bench latency --model "${MODEL_DIR:-$CKPT}" --dtype bfloat16 --batch-size "$batch" \
    --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --num-iters "$ITERS" --num-iters-warmup 1 --max-num-seqs 8 \
    --json "$OUT/lat-$name-b$batch.json" "$@" >"$OUT/lat-$name-b$batch.txt" 2>&1 || say "$name b$batch failed or timed out"
  grep -E "batch latency|output tok/s|speculative" "$OUT/lat-$name-b$batch.txt" | tee -a "$LOG"
}
for b in 1 8; do
  lat plain "$b"
  lat draft-self "$b" --speculative-config "{\"method\": \"draft_model\", \"model\": \"$CKPT\", \"num_speculative_tokens\": $SPEC_K}"
  lat ngram "$b" --prompt-period 8 --speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $SPEC_K}"
done
if [ "$MTP" = 1 ]; then
  DS=/tmp/spec-deepseek-v3-4l
  $PY -c "from pagoda.bench.shapes import write_shape; write_shape('deepseek-v3-4l', '$DS')" >>"$LOG" 2>&1
  MODEL_DIR=$DS lat ds-plain 1 --load-format dummy
  MODEL_DIR=$DS lat ds-mtp 1 --load-format dummy --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'
fi
if [ "$EAGLE3" = 1 ]; then  # (after MTP: the rows added last)
  for b in 1 8; do
    lat eagle3-random "$b" --speculative-config "{\"method\": \"eagle3\", \"model\": \"$HEAD\", \"num_speculative_tokens\": $SPEC_K}"
  done
fi

$PY - "$OUT" <<'PYEOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'case':<14}{'batch':>6}{'ms/token':>10}{'tok/s':>10}{'itl p50':>9}{'accept':>8}{'len/verify':>11}")
for path in sorted(out.glob("lat-*.json")):
    r = json.loads(path.read_text())
    w, spec = r["workload"], r.get("speculative") or {}
    per_token = 1000 * r["batch_latency_s"]["mean"] / w["output_len"]
    name = path.stem.removeprefix("lat-").rsplit("-b", 1)[0]
    acc = f"{spec['acceptance_rate']:.2f}" if spec else "-"
    length = f"{spec['mean_accepted_length']:.2f}" if spec else "-"
    print(f"{name:<14}{w['batch_size']:>6}{per_token:>10.2f}{r['output_tok_s']:>10,.0f}"
          f"{r['requests_ms']['itl']['p50'] or 0:>9.2f}{acc:>8}{length:>11}")
print("ms/token: batch latency / output tokens (each request's mean inter-token latency); itl p50 is 0 when "
      "tokens arrive in bursts")
PYEOF
say "done"
