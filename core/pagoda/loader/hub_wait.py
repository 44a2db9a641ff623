"""One download per machine when torchrun starts the ranks: local rank 0 downloads, the others wait.

Every rank of a torchrun job resolves the model before the process group exists, so they meet
through a marker file in the temporary directory, keyed by what is resolved and by the job's
``MASTER_ADDR``/``MASTER_PORT``: local rank 0 writes the folder it resolved (or its error), the
other ranks on the machine wait for a marker written after they started (less a skew allowance)
and use its folder, or raise its error. Ranks that pagoda starts itself never get here: rank 0
resolves before it starts them and hands them the local folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pagoda.errors import ModelLoadError, PagodaError

logger = logging.getLogger("pagoda")
WAIT_TIMEOUT_S = float(os.environ.get("PAGODA_DOWNLOAD_WAIT_S", 6 * 3600))
START_SKEW_S = 300.0  # ranks of one job start within this long of each other
POLL_S = 1.0


def marker_path(key: str) -> Path:
    job = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    digest = hashlib.sha1(f"{job}|{key}".encode()).hexdigest()[:20]
    return Path(tempfile.gettempdir()) / "pagoda-hub" / f"{digest}.json"


def once_per_machine(key: str, resolve: Callable[[], Path]) -> Path:
    from pagoda.distributed.process_group import launcher_env

    info = launcher_env()
    if info is None:
        return resolve()
    marker = marker_path(key)
    if info.local_rank != 0:
        return wait_for(marker, key, time.time())
    try:
        result = resolve()
    except PagodaError as exc:
        _write(marker, {"error": str(exc)})
        raise
    except BaseException as exc:
        _write(marker, {"error": f"{type(exc).__name__}: {exc}"})
        raise
    _write(marker, {"path": str(result)})
    return result


def wait_for(marker: Path, key: str, started: float, timeout: float = WAIT_TIMEOUT_S) -> Path:
    deadline = started + timeout
    last_note = started
    while True:
        found = _read_fresh(marker, started - START_SKEW_S)
        if found is not None:
            if "error" in found:
                raise ModelLoadError(f"local rank 0 failed to fetch {key.split('@')[0]}: {found['error']}")
            return Path(found["path"])
        now = time.time()
        if now > deadline:
            raise ModelLoadError(f"waited {timeout:.0f} s for local rank 0 to fetch {key.split('@')[0]} "
                                 f"(marker {marker}); set PAGODA_DOWNLOAD_WAIT_S to wait longer")
        if now - last_note > 60:
            logger.info("waiting for local rank 0 to fetch %s", key.split("@")[0])
            last_note = now
        time.sleep(POLL_S)


def _read_fresh(marker: Path, not_before: float) -> dict | None:
    try:
        if marker.stat().st_mtime < not_before:
            return None  # a previous job's
        return json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _write(marker: Path, value: dict) -> None:
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, marker)  # readers see the whole file or none
