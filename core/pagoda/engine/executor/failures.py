"""What went wrong on which rank: reports through the run's store, exit descriptions, the error.

A rank that raises writes ``ExceptionType: message`` and its traceback under
``pagoda/failure/<rank>`` in the run's ``torch.distributed`` store (the TCPStore pagoda
starts, or torchrun's), then exits; its peers' collectives then fail, and rank 0 turns what
it finds — reports, exit statuses of its local workers — into one ``WorkerError``.
"""

from __future__ import annotations

import logging
import signal
import traceback
from typing import Any

from pagoda.errors import PagodaError

logger = logging.getLogger("pagoda")
FAILURE_KEY = "pagoda/failure/{rank}"


class WorkerError(PagodaError):
    """A rank of a tensor-parallel run failed; the engine stopped. ``ranks`` lists the ranks
    at fault (root causes first)."""

    def __init__(self, message: str, ranks: list[int] | None = None):
        super().__init__(message)
        self.ranks = ranks or []


def is_communication_error(exc: BaseException) -> bool:
    """A collective failed because a peer went away (as opposed to a bug on this rank)."""
    import torch.distributed as dist

    kinds = tuple(k for k in (getattr(dist, "DistError", None), getattr(dist, "DistBackendError", None),
                              getattr(dist, "DistNetworkError", None)) if k is not None)
    if kinds and isinstance(exc, kinds):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in (
        "connection closed", "connection reset", "broken pipe", "gloo", "nccl", "timed out", "socket"))


def exception_summary(exc: BaseException) -> str:
    """``ValueError: message`` (the first line of the message)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def release_frames(exc: BaseException) -> None:
    """Clear the locals of the finished frames in ``exc``'s traceback and its causes'. A failed collective's
    frames hold its process group; the error outlives the run (``run.error``, the caller's handler), and
    would keep the group, and gloo's threads, alive until the interpreter's exit (see
    ``pagoda.distributed.process_group.destroy_parallel_state``). The traceback's lines stay."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def report_failure(store: Any, rank: int, exc: BaseException) -> None:
    """Log the traceback and leave a report for rank 0 (best effort: the store may be gone)."""
    detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    logger.error("rank %d failed:\n%s", rank, detail)
    if store is None:
        return
    try:
        store.set(FAILURE_KEY.format(rank=rank), exception_summary(exc) + "\n" + detail)
    except Exception:
        pass


def read_failure(store: Any, rank: int) -> str | None:
    """The summary line a rank reported, if any."""
    if store is None:
        return None
    key = FAILURE_KEY.format(rank=rank)
    try:
        if not store.check([key]):
            return None
        return store.get(key).decode(errors="replace").splitlines()[0]
    except Exception:
        return None


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"
