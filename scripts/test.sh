#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole CPU test suite, as CI does.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
ruff check core plugins tests examples scripts
python -m pytest -q -ra "$@"
