#!/usr/bin/env bash
# GPU checks of pagoda-quant, on a CUDA machine (standalone, or called from scripts/gpu_check.sh):
#   1. the plugin's tests on the GPU: Triton kernels against the torch reference
#   2. kernels at real shapes (Phi-3-mini, Llama-3-8B layers; Qwen3-30B-A3B experts) against the
#      reference and timed against bf16, for 1..4096 tokens (python -m pagoda_cuda.quant.gpu_check)
#   3. pagoda bench throughput of phi3-mini (3.8B) in bf16, fp8 and int4: the anchor workload
#      (256 prompts) and a small batch, where INT4's smaller weight reads should pay most
# Results go to $OUT/quant (default out/quant); the exit status is non-zero if a kernel is out of
# tolerance or a step fails. QUANT_SHAPE=llama3-8b (any shape the bench knows) changes step 3's model.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
OUT_DIR="${OUT:-out}/quant"
SHAPE="${QUANT_SHAPE:-phi3-mini}"
mkdir -p "$OUT_DIR"
status=0

echo "== pagoda-quant tests on $(python -c 'import torch; print(torch.cuda.get_device_name())')"
python -m pytest -q plugins/quant/tests 2>&1 | tee "$OUT_DIR/tests.txt" | tail -5
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== kernels at real shapes"
python -m pagoda_cuda.quant.gpu_check --json "$OUT_DIR/kernels.json" 2>&1 | tee "$OUT_DIR/kernels.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== throughput: $SHAPE in bf16 / fp8 / int4"
if ! pagoda bench throughput --help >/dev/null 2>&1; then
  echo "pagoda bench throughput is not available in this build: skipped" | tee "$OUT_DIR/throughput.txt"
  exit $status
fi
HELP=$(pagoda bench throughput --help)
for batch in large small; do
  extra=()
  if [ "$batch" = small ]; then
    if grep -q -- "--num-prompts" <<<"$HELP"; then extra=(--num-prompts 8); else continue; fi
  fi
  for quant in none fp8 int4; do
    qarg=()
    [ "$quant" = none ] || qarg=(--quantization "$quant")
    name="$OUT_DIR/throughput_${SHAPE}_${quant}_${batch}"
    echo "-- $SHAPE $quant ($batch batch)"
    if pagoda bench throughput --shape "$SHAPE" "${qarg[@]}" "${extra[@]}" --json "$name.json" >"$name.txt" 2>&1; then
      tail -3 "$name.txt"
    else
      status=1
      tail -20 "$name.txt"
    fi
  done
done
exit $status
