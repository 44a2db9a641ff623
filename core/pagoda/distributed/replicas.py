"""The front's view of its replicas (``pagoda.distributed.data_parallel``): their processes, started and
stopped (``start_replicas``, ``stop_replicas``), each one's connection, unfinished requests and last stats;
where a request goes (``choose_replica``); the seats the server's ``AsyncEngine`` reads as a scheduler's
(``SchedulerView``)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Listener
from typing import Any

from pagoda.distributed.dp_replica import ENV_ADDRESS, ENV_AUTHKEY, ENV_INDEX
from pagoda.errors import ConfigError

AFFINITY_SLACK = 4  # requests a prefix's replica may be ahead of the least loaded one (x2 + this)
# a launcher's variables (torchrun's) are not the replicas': each replica starts its own ranks
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                  "GROUP_RANK", "TORCHELASTIC_RUN_ID")


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


def start_replicas(size: int, platform, ranks: int) -> tuple[Listener, list[Replica]]:
    """``size`` replica processes (``python -m pagoda.distributed.dp_replica``), each told where to connect
    back (a local listener with a fresh key) and, where the platform limits a process to some devices, given
    ``ranks`` devices of its own; they connect and take their config afterwards (``DataParallelEngine``)."""
    devices = _device_lists(platform, size, ranks)
    authkey = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update({ENV_ADDRESS: f"127.0.0.1:{listener.address[1]}", ENV_AUTHKEY: authkey.hex()})
    replicas = []
    for i in range(size):
        extra = {ENV_INDEX: str(i)}
        if devices is not None:
            extra[platform.visible_devices_env] = ",".join(devices[i])
        proc = subprocess.Popen([sys.executable, "-m", "pagoda.distributed.dp_replica"], env={**env, **extra})
        replicas.append(Replica(i, proc, alone=size == 1))
    return listener, replicas


def _device_lists(platform, size: int, ranks: int) -> list[list[str]] | None:
    """Replica i's devices: ``[i*ranks, (i+1)*ranks)`` of the visible ones (None: replicas share the device)."""
    var = platform.visible_devices_env
    if var is None:  # (the CPU)
        return None
    visible = os.environ.get(var)
    ids = [d for d in visible.split(",") if d] if visible else [str(i) for i in range(platform.device_count())]
    if len(ids) < size * ranks:
        raise ConfigError(f"data_parallel_size={size} x {ranks} ranks per replica needs {size * ranks} "
                          f"{platform.name} devices, but {len(ids)} are visible")
    return [ids[i * ranks:(i + 1) * ranks] for i in range(size)]


def stop_replicas(replicas: list[Replica], listener: Listener) -> None:
    """Ask each replica to stop, wait for it (10 s for all, then killed), close the connections."""
    for replica in replicas:
        if replica.conn is not None:
            try:
                replica.conn.send(("stop",))
            except OSError:
                pass
    deadline = time.monotonic() + 10.0
    for replica in replicas:
        try:
            replica.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            replica.proc.kill()
            replica.proc.wait()
        if replica.conn is not None:
            replica.conn.close()
    listener.close()
