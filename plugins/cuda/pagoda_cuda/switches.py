"""pagoda-cuda's environment switches for kernels that are off until measured (docs/cuda.md), read without
importing triton. A bad value must not turn into a kernel import failure (the kernel registry would then
fall back to the torch reference with only a warning): the kernel modules read them leniently, and the
platform's ``set_device`` calls ``check`` so that the engine refuses to start, naming the variable."""

from __future__ import annotations

import os

from pagoda.errors import ConfigError

SKINNY_ROWS_VAR = "PAGODA_CUDA_SKINNY_ROWS"
PDL_VAR = "PAGODA_CUDA_PDL"
MAX_SKINNY_ROWS = 16  # pagoda_cuda.ops.linear pads its rows to 16 (one tensor-core tile)


def skinny_rows() -> int:
    """Rows up to which ``linear`` runs pagoda-cuda's product of a few rows (0: torch's at every size)."""
    raw = os.environ.get(SKINNY_ROWS_VAR, "0").strip() or "0"
    try:
        rows = int(raw)
    except ValueError:
        rows = -1
    if not 0 <= rows <= MAX_SKINNY_ROWS:
        raise ConfigError(f"{SKINNY_ROWS_VAR}={raw!r}: expected a number of rows from 0 to {MAX_SKINNY_ROWS}")
    return rows


def pdl_requested() -> bool:
    """Whether the decode path's kernels may use programmatic dependent launch."""
    raw = os.environ.get(PDL_VAR, "0").strip().lower()
    if raw not in ("", "0", "1", "false", "true"):
        raise ConfigError(f"{PDL_VAR}={raw!r}: expected 1 or 0")
    return raw in ("1", "true")


def check() -> None:
    """Raise ConfigError for a switch set to a value it does not take."""
    skinny_rows()
    pdl_requested()


def lenient(read, default):
    """``read()``, or ``default`` where its variable is malformed (``check`` reports that at start-up)."""
    try:
        return read()
    except ConfigError:
        return default
