"""Where the Triton attention backends can run (no triton import: discovery stays light)."""

from __future__ import annotations

import importlib.util
import os


def triton_unavailable_reason(platform: str) -> str | None:
    """None on CUDA with triton installed, or on the CPU under the Triton interpreter (tests)."""
    if platform == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return "runs on cpu only under the Triton interpreter (TRITON_INTERPRET=1)"
    if importlib.util.find_spec("triton") is None:
        return "needs the triton package (pip install triton)"
    return None
