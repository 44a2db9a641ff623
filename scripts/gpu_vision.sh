#!/usr/bin/env bash
# Vision-language serving (issue 23) on one lent H200 (nvidia-h200), in under 4 minutes:
#   1. correctness: a tiny Qwen2.5-VL (random weights) on the GPU gives transformers' greedy tokens for one
#      image, two images and text only, batched with chunked prefill through the images and preemption
#   2. the image workload of `pagoda bench throughput` on a qwen2.5-vl-3b shape (random weights): images/s
#      and output tok/s, and the same shape text-only for comparison
# Results go to $OUT (default out/vision): vision.log, bench-image.json, bench-text.json, summary.json.
#
# Before the call, on the development machine (once), as for gpu_check.sh:
#   mkdir -p .whl && cp /work/shared/gpu-wheels/*.whl .whl/     # .whl/ is git-ignored; carry it
# Images need Pillow, which /work/shared/gpu-wheels may lack; add its wheel for the GPU machine's Python:
#   pip download --only-binary=:all: --no-deps --python-version 3.12 --platform manylinux2014_x86_64 pillow -d .whl/
# Run (device tool, kind nvidia-h200, carry [".whl"]):   bash scripts/gpu_vision.sh
# Settings (environment variables):
#   SECTIONS="check bench"  NUM_PROMPTS=64 INPUT_LEN=128 OUTPUT_LEN=128 IMAGES=1 IMAGE_SIZE=448x448
#   CHECK_TIMEOUT=60 BENCH_TIMEOUT=90
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/vision}
mkdir -p "$OUT"
LOG="$OUT/vision.log"
SECTIONS=${SECTIONS:-"check bench"}
NUM_PROMPTS=${NUM_PROMPTS:-64}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-128}
IMAGES=${IMAGES:-1}
IMAGE_SIZE=${IMAGE_SIZE:-448x448}
CHECK_TIMEOUT=${CHECK_TIMEOUT:-60}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-90}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
say() { echo "[vision +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
has() { [[ " $SECTIONS " == *" $1 "* ]]; }

# shellcheck source=scripts/gpu_install.sh
. scripts/gpu_install.sh
$PY -c "import torch, pagoda; print('torch', torch.__version__, '| pagoda', pagoda.__version__, '|',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda')" 2>&1 | tee -a "$LOG"
$PY -c "import PIL" 2>/dev/null || { say "ERROR: Pillow is not installed here: add its wheel to .whl/ (see the header)"; exit 1; }

if has check; then
  say "tiny Qwen2.5-VL on the GPU against transformers (one image, two images, text; chunked, preempted)"
  timeout "$CHECK_TIMEOUT" $PY - <<'EOF' 2>&1 | grep -v -E "^(USDT|STAGE:)|Writing model shards" | tee -a "$LOG"
import tempfile
from transformers import AutoTokenizer
from pagoda import LLM, SamplingParams
from pagoda.testing.vision import hf_greedy, make_tiny_qwen2_5_vl, random_image

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
with tempfile.TemporaryDirectory() as d:
    hf = make_tiny_qwen2_5_vl(d)
    hf.generation_config.eos_token_id = None
    tok = AutoTokenizer.from_pretrained(d)
    imgs = [random_image(120, 90, 1), random_image(200, 150, 2)]
    cases = [(f"a {IMAGE} describe", imgs[:1]), (f"x {IMAGE} y {IMAGE} compare", imgs), ("only text here", [])]
    want = [hf_greedy(hf, d, tok.encode(t), ims, 10) for t, ims in cases]
    llm = LLM(d, device="cuda", dtype="float32", block_size=16, max_num_batched_tokens=32, num_kv_blocks=8,
              max_model_len=96, max_num_seqs=3, enable_prefix_caching=False, seed=0)
    prompts = [{"prompt": t, "multi_modal_data": {"image": ims}} if ims else {"prompt": t} for t, ims in cases]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    ok = [o.outputs[0].token_ids == w for o, w in zip(outs, want)]
    print("vision check:", "PASS" if all(ok) else "FAIL", ok, "preemptions", llm.get_stats()["num_preemptions"])
EOF
  say "check done (exit ${PIPESTATUS[0]})"
fi
if has bench; then
  for kind in image text; do
    n=$IMAGES; [ "$kind" = text ] && n=0
    say "bench qwen2.5-vl-3b $kind: $NUM_PROMPTS prompts x ($n x $IMAGE_SIZE + $INPUT_LEN) in x $OUTPUT_LEN out"
    timeout "$BENCH_TIMEOUT" $PY -m pagoda.cli.main bench throughput --shape qwen2.5-vl-3b \
      --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos --repeats 2 \
      --warmup-prompts 16 --images-per-prompt "$n" --image-size "$IMAGE_SIZE" --json "$OUT/bench-$kind.json" \
      2>&1 | grep -v -E "^(USDT|STAGE:)" | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" = 0 ] || say "bench $kind failed or timed out"
  done
  $PY - "$OUT" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = []
for kind in ("image", "text"):
    path = out / f"bench-{kind}.json"
    if not path.is_file():
        continue
    r = json.loads(path.read_text())
    w, b = r["workload"], r["best"]
    rows.append({"workload": kind, "images_per_prompt": w["images_per_prompt"], "image_size": w["image_size"],
                 "num_prompts": w["num_prompts"], "input_tokens": b["input_tokens"], "images_per_s": b["images_per_s"],
                 "output_tok_s": b["output_tok_s"], "prefill_s": b["times"]["prefill"],
                 "decode_s": b["times"]["decode"], "elapsed_s": b["elapsed_seconds"], "device": r["device"]})
(out / "summary.json").write_text(json.dumps(rows, indent=1))
print(f"{'workload':<8} {'images/s':>9} {'output tok/s':>13} {'input tok':>10} {'prefill s':>10} {'decode s':>9}")
for x in rows:
    print(f"{x['workload']:<8} {x['images_per_s']:>9,.1f} {x['output_tok_s']:>13,.0f} {x['input_tokens']:>10,} "
          f"{x['prefill_s']:>10.2f} {x['decode_s']:>9.2f}")
EOF
fi
say "done; results in $OUT"
