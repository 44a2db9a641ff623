"""A cache of a GGUF file's weights in the CPU kernel's layout, so that later starts map them instead of repacking.

Decoding a file's blocks into 4-bit digit planes and packing them for torch's CPU kernel is most of
``LLM()``'s time on the CPU (docs/cpu.md). The planes depend only on the file, torch's packed layout
(which follows the CPU's instruction set) and this format, so the first load writes them to one file
per GGUF file and later loads map that file (``torch.load(mmap=True)``: nothing is read until used,
and the pages are shared between processes serving the same model).

    $PAGODA_CACHE_DIR/gguf-packed/<digest of path, size, mtime, torch, layout>.pt
    (default $XDG_CACHE_HOME/pagoda, else ~/.cache/pagoda; PAGODA_GGUF_CACHE=0 turns it off)

The file is written once, atomically (a temporary file renamed into place), and only when this load
packed something new; a cache that cannot be read or written is logged and ignored: the planes are
then packed as without it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("pagoda")

FORMAT = 3  # bump when the entries' layout changes


def cache_dir() -> Path | None:
    """Where the packed-weight caches go; None when PAGODA_GGUF_CACHE=0."""
    if os.environ.get("PAGODA_GGUF_CACHE", "1") in ("0", "false", "no", "off"):
        return None
    from pagoda.kernels.native import cache_root

    return cache_root() / "gguf-packed"


def _layout_signature() -> str:
    """The kernel the weights are laid out for: the int8 dot-product kernel's layouts (fixed), or the packed
    layout of torch's int4 kernel on this CPU, as the bytes of a packed probe."""
    from pagoda_quant.kernels import cpu_int8dot

    if cpu_int8dot.available():
        return "int8dot"
    probe = (torch.arange(64 * 64, dtype=torch.int32).view(64, 64) * 7 + 3) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    return hashlib.sha256(packed.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


class PackedCache:
    """The packed planes of one GGUF file's layers: ``get(name)`` -> segments or None, ``put``, ``save``."""

    def __init__(self, gguf_path: str | os.PathLike, directory: Path):
        path = Path(gguf_path).resolve()
        stat = path.stat()
        key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{torch.__version__}|{_layout_signature()}|{FORMAT}"
        self.file = directory / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"
        self.entries: dict[str, list] = {}
        self.new = 0  # layers packed by this load (the file is written when there are any)
        self.hits = 0
        if self.file.exists():
            try:
                self.entries = torch.load(self.file, mmap=True, weights_only=True)
            except Exception as exc:  # noqa: BLE001 - a broken cache is rebuilt, never fatal
                logger.warning("the packed-weight cache %s could not be read (%s); packing again", self.file, exc)

    def get(self, name: str):
        """The layer's segments as cached (planes mapped from the file), or None."""
        from pagoda_quant.kernels.cpu_int4pack import PackedPlane
        from pagoda_quant.kernels.cpu_int8dot import DotWeight
        from pagoda_quant.methods.gguf_cpu import _Segment

        entry = self.entries.get(name)
        if entry is None:
            return None
        segments = []
        for seg in entry:
            if "dot" in seg:
                segments.append(_Segment(seg["rows"], dot=DotWeight.from_state(seg["dot"])))
                continue
            planes = []
            for p in seg["planes"]:
                plane = PackedPlane.__new__(PackedPlane)
                plane.n, plane.k = p["n"], p["k"]
                plane.packed, plane.scales_zeros, plane.codes = p["packed"], p["scales_zeros"], p["codes"]
                planes.append(plane)
            segments.append(_Segment(seg["rows"], planes=planes))
        self.hits += 1
        return segments

    def put(self, name: str, segments) -> None:
        """Remember a layer's segments (only when none of them is a float weight)."""
        if any(s.planes is None and s.dot is None for s in segments):
            return
        self.entries[name] = [{"rows": s.rows, "dot": s.dot.state()} if s.dot is not None else {
            "rows": s.rows, "planes": [{"n": p.n, "k": p.k, "packed": p.packed, "scales_zeros": p.scales_zeros,
                                        "codes": p.codes} for p in s.planes]} for s in segments]
        self.new += 1

    def save(self) -> None:
        if not self.new:
            return
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.file.parent, prefix=".packing-", suffix=".pt")
            with os.fdopen(fd, "wb") as f:
                torch.save(self.entries, f)
            os.replace(tmp, self.file)
            logger.info("packed GGUF weights cached in %s (later starts map them)", self.file)
        except OSError as exc:
            logger.warning("the packed-weight cache %s could not be written (%s)", self.file, exc)
            try:
                os.unlink(tmp)
            except (OSError, UnboundLocalError):
                pass
