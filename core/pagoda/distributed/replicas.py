"""The front's view of its replicas (``pagoda.distributed.data_parallel``): each replica's process,
connection, unfinished requests and last stats; where a request goes (``choose_replica``); the seats the
server's ``AsyncEngine`` reads as a scheduler's (``SchedulerView``)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Any

AFFINITY_SLACK = 4  # requests a prefix's replica may be ahead of the least loaded one (x2 + this)


def choose_replica(loads: list[float], preferred: int | None) -> int:
    """The replica for a request: ``preferred`` (its prefix's) unless much more loaded."""
    least = min(range(len(loads)), key=lambda i: (loads[i], i))
    if preferred is not None and loads[preferred] <= 2 * loads[least] + AFFINITY_SLACK:
        return preferred
    return least


class Seat:
    __slots__ = ("request_id",)

    def __init__(self, request_id: str):
        self.request_id = request_id


class SchedulerView:
    """What the server's ``AsyncEngine`` reads of a scheduler (its queue limit, ``max_queued_requests``):
    each replica's unfinished requests, the first ``max_num_seqs`` of them running and the rest waiting
    (the front does not see the replicas' queues; requests with n > 1 count once)."""

    def __init__(self, replicas: list[Replica], max_num_seqs: int, max_num_batched_tokens: int | None):
        self._replicas, self._seats = replicas, max_num_seqs
        self.max_num_seqs, self.max_num_batched_tokens = len(replicas) * max_num_seqs, max_num_batched_tokens

    @property
    def running(self) -> list[Seat]:
        return [Seat(rid) for r in self._replicas for rid in list(r.unfinished)[:self._seats]]

    @property
    def waiting(self) -> list[Seat]:
        return [Seat(rid) for r in self._replicas for rid in list(r.unfinished)[self._seats:]]


class Replica:
    def __init__(self, index: int, proc: subprocess.Popen, alone: bool = False):
        self.index, self.proc, self.alone = index, proc, alone  # alone: the server's one engine process
        self.conn: Any = None
        self.unfinished: set[str] = set()
        self.stats: dict = {}
        self.choices: str | None = None  # what its engine chose on the CPU (pagoda.cli.serve.cpu_choices)
        self.pooling: PoolingView | None = None  # its engine's, with runner: pooling

    def kv_usage(self) -> float:
        total = self.stats.get("kv_blocks_total") or 0
        return self.stats.get("kv_blocks_used", 0) / total if total else 0.0

    def describe(self) -> str:
        return f"the engine process (pid {self.proc.pid})" if self.alone else \
            f"data-parallel replica {self.index} (pid {self.proc.pid})"


@dataclass(frozen=True)
class PoolingHead:
    num_labels: int


@dataclass(frozen=True)
class PoolingView:
    """What the server reads of a pooling engine (``runner: pooling``) in another process."""

    tasks: tuple[str, ...]
    hidden_size: int
    head: PoolingHead | None

    @classmethod
    def of(cls, engine) -> PoolingView | None:
        pooling = engine.pooling
        if pooling is None:
            return None
        head = PoolingHead(int(pooling.head.num_labels)) if pooling.head is not None else None
        return cls(tuple(pooling.tasks), pooling.hidden_size, head)
