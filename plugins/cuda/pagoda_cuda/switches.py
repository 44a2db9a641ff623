"""pagoda-cuda's environment switches for kernel paths (docs/cuda.md), read without importing triton: programmatic
dependent launch (``PAGODA_CUDA_PDL``, on unless set to 0) and the product of a few rows
(``PAGODA_CUDA_SKINNY_ROWS``, by default up to 16 rows where PDL is on: both were measured faster together on an
H200, docs/benchmarks.md, nineteenth session). A bad value must not turn into a kernel import failure (the
kernel registry would then fall back to the torch reference with only a warning): the kernel modules read them
leniently, and the platform's ``set_device`` calls ``check`` so that the engine refuses to start, naming the
variable."""

from __future__ import annotations

import os

from pagoda.errors import ConfigError

SKINNY_ROWS_VAR = "PAGODA_CUDA_SKINNY_ROWS"
PDL_VAR = "PAGODA_CUDA_PDL"
MAX_SKINNY_ROWS = 16  # pagoda_cuda.ops.linear pads its rows to 16 (one tensor-core tile)


def skinny_rows() -> int:
    """Rows up to which ``linear`` runs pagoda-cuda's product of a few rows (0: torch's at every size). Unset:
    MAX_SKINNY_ROWS where programmatic dependent launch is on, else 0 (without PDL the product was measured no
    faster than cuBLAS at batch 8)."""
    raw = os.environ.get(SKINNY_ROWS_VAR, "").strip()
    if not raw:
        return MAX_SKINNY_ROWS if lenient(pdl_requested, False) else 0
    try:
        rows = int(raw)
    except ValueError:
        rows = -1
    if not 0 <= rows <= MAX_SKINNY_ROWS:
        raise ConfigError(f"{SKINNY_ROWS_VAR}={raw!r}: expected a number of rows from 0 to {MAX_SKINNY_ROWS}")
    return rows


def pdl_requested() -> bool:
    """Whether the decode path's kernels may use programmatic dependent launch (unset: yes)."""
    raw = os.environ.get(PDL_VAR, "").strip().lower()
    if raw not in ("", "0", "1", "false", "true"):
        raise ConfigError(f"{PDL_VAR}={raw!r}: expected 1 or 0")
    return raw in ("", "1", "true")


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
