# Sourced by the GPU scripts (gpu_check.sh, gpu_tp_check.sh, gpu_extra_check.sh) on a lent CUDA machine:
# installs the carried wheels (.whl/, from /shared/gpu-wheels) and pagoda with every plugin into $SITE,
# without network, and puts them on PYTHONPATH and PATH. Expects: PY, LOG, and a `say` function.
SITE=${SITE:-/tmp/pagoda-site}
mkdir -p "$SITE"
if ls .whl/*.whl >/dev/null 2>&1; then
  say "installing carried wheels from .whl/"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    >>"$LOG" 2>&1 || say "WARNING: wheel install failed (see log)"
fi
PROJECTS=". $(for d in plugins/*/; do [ -f "$d/pyproject.toml" ] && printf '%s ' "$d"; done)"
say "installing pagoda: $PROJECTS"
# shellcheck disable=SC2086
$PY -m pip install -q --no-deps --no-build-isolation --no-index --no-compile --upgrade --target "$SITE" $PROJECTS \
  >>"$LOG" 2>&1 || { say "ERROR: installing pagoda failed"; tail -20 "$LOG"; exit 1; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
