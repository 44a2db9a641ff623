"""C kernels for the CPU, compiled at first use with the system's compiler and loaded through ctypes.

Where torch has no fast CPU kernel for an op (the int8 dot products of GGUF weights, a decode step's
many small per-token ops), pagoda keeps a short C file beside its Python wrapper and builds it here:
``cc -O3 -march=native -fopenmp -shared`` into ``$PAGODA_CACHE_DIR/kernels/`` (default
``$XDG_CACHE_HOME/pagoda``, else ``~/.cache/pagoda``), the library's name covering the source, the
compiler's binary, the flags and this CPU's instruction-set flags, so another machine or compiler
builds its own. A build takes about a second; it is atomic (a temporary file renamed into place), so
processes starting together each load a whole library. Without a compiler, on a CPU that is not x86,
or where the build fails (logged once), ``load`` returns None and the caller keeps its torch path.
``PAGODA_CPU_NATIVE=0`` turns every such kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger("pagoda")

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-Werror=implicit-function-declaration")


def cache_root() -> Path:
    """pagoda's cache folder: $PAGODA_CACHE_DIR, else $XDG_CACHE_HOME/pagoda, else ~/.cache/pagoda."""
    root = os.environ.get("PAGODA_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg, "pagoda") if xdg else os.path.join(os.path.expanduser("~"), ".cache", "pagoda")
    return Path(root)


def enabled() -> bool:
    return os.environ.get("PAGODA_CPU_NATIVE", "1") not in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.lru_cache(maxsize=1)
def _compiler() -> tuple[str, str] | None:
    """(compiler, what identifies its build: the resolved binary's path, size and modification time), or
    None. (A stat, not ``cc --version``: a start-up should not spawn a process to find a cached build.)"""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    try:
        real = os.path.realpath(shutil.which(compiler) or compiler)
        stat = os.stat(real)
    except OSError:
        return None
    return compiler, f"{real}:{stat.st_size}:{stat.st_mtime_ns}"


def _build(compiler: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, str(source), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode:
            raise RuntimeError(done.stderr.strip()[-2000:])
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load(source: Path) -> ctypes.CDLL | None:
    """The compiled library of the C file ``source`` (built on first use), or None where it cannot be."""
    if not enabled() or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    found = _compiler()
    if found is None:
        logger.info("no C compiler found: %s is not built (torch's kernels are used instead)", source.name)
        return None
    compiler, version = found
    key = hashlib.sha256("|".join((source.read_text(), compiler, version, " ".join(FLAGS), _cpu_flags(),
                                   platform.machine())).encode()).hexdigest()[:20]
    target = cache_root() / "kernels" / f"{source.stem}-{key}.so"
    try:
        if not target.exists():
            _build(compiler, source, target)
        return ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("the CPU kernel %s could not be built (%s): torch's kernels are used instead",
                       source.name, exc)
        return None
