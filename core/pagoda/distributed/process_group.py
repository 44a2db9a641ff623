"""Joining a tensor-parallel run: who launched us, the process groups, this rank's device.

Two ways to start the ranks of one model:

- pagoda starts them itself (``tensor_parallel_size: N`` in a plain process): the engine's
  process is rank 0 and starts ranks 1..N-1 as ``python -m pagoda.engine.executor.worker_main``
  on this machine, rendezvousing through a ``torch.distributed.TCPStore`` on 127.0.0.1;
- torchrun (or any launcher that sets the ``env://`` variables RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT, LOCAL_RANK): every process runs the same command, the one with
  RANK 0 becomes the engine and the others serve it; several machines join through
  torchrun's rendezvous.

Each rank gets two groups: the default group on the platform's ``dist_backend`` (NCCL on
CUDA, gloo on CPU, ...) that the layers all-reduce over, and a gloo group for the control
plane (each step's inputs and the engine's calls), which always lives on the host.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagoda.config import EngineConfig
from pagoda.distributed import parallel_state
from pagoda.errors import ConfigError
from pagoda.interfaces import Platform

ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# How long a collective may wait before the backend gives up (a stuck, not dead, peer).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass
class RankInfo:
    rank: int
    world_size: int
    local_rank: int  # index of this rank's device on its machine
    local_world_size: int
    launcher: str  # "pagoda" (local workers) or "torchrun" (env:// variables)


def launcher_env() -> RankInfo | None:
    """The rank given by torchrun (or another ``env://`` launcher), None in a plain process
    or a run of one process."""
    if not all(v in os.environ for v in ENV_VARS):
        return None
    try:
        world = int(os.environ["WORLD_SIZE"])
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError as exc:
        raise ConfigError(f"torchrun environment: RANK/WORLD_SIZE/LOCAL_RANK must be integers ({exc})") from None
    if world <= 1:
        return None
    return RankInfo(rank, world, local_rank, local_world, "torchrun")


def check_world(config: EngineConfig, platform: Platform, info: RankInfo | None) -> None:
    """Clear errors for a size mismatch with the launcher and for more ranks than devices."""
    tp = config.tensor_parallel_size * config.pipeline_parallel_size  # every rank of the run
    if info is not None and info.world_size != tp:
        pp = f" x pipeline_parallel_size {config.pipeline_parallel_size}" if config.pipeline_parallel_size > 1 else ""
        raise ConfigError(
            f"torchrun started {info.world_size} processes (WORLD_SIZE={info.world_size}) but "
            f"tensor_parallel_size is {config.tensor_parallel_size}{pp}: pass --tensor-parallel-size "
            f"{info.world_size} (or a tensor x pipeline product of it; every rank of the run holds one shard "
            f"of the model)")
    if platform.device_type == "cpu":
        return  # ranks share the host's cores
    local = info.local_world_size if info is not None else tp
    have = platform.device_count()
    if local > have:
        where = "on this machine (torchrun --nproc-per-node)" if info is not None else "on this machine"
        raise ConfigError(
            f"tensor_parallel_size={tp} needs {local} {platform.name} devices {where}, but {have} "
            f"{'is' if have == 1 else 'are'} visible: lower tensor_parallel_size or spread the ranks over "
            f"several machines with torchrun (docs/distributed.md)")


def init_parallel_state(config: EngineConfig, platform: Platform, info: RankInfo, store: Any = None) -> Any:
    """Join the default group (``store`` for pagoda's own workers, ``env://`` for torchrun),
    create the gloo control group and set the parallel state the layers read. Returns the
    control group."""
    backend = platform.dist_backend
    platform.set_device(info.local_rank)  # before the group: NCCL binds its communicator to the current device
    if not dist.is_available():
        raise ConfigError("tensor_parallel_size > 1 needs torch.distributed, which this torch build lacks")
    if dist.is_initialized():
        raise ConfigError("torch.distributed is already initialised in this process: one tensor-parallel "
                          "engine per process (shut the previous one down first)")
    kwargs: dict[str, Any] = dict(backend=backend, rank=info.rank, world_size=info.world_size,
                                  timeout=COLLECTIVE_TIMEOUT)
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = "env://"
    dist.init_process_group(**kwargs)
    control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend != "gloo" else dist.group.WORLD
    if config.pipeline_parallel_size > 1:  # a tensor-parallel group per stage (pagoda.distributed.pipeline_parallel)
        from pagoda.distributed.pipeline_parallel import init_pipeline_groups

        init_pipeline_groups(config, info.rank, info.world_size)
    else:
        parallel_state.set_tp_group(dist.group.WORLD, info.rank, info.world_size)
    placement = None
    if config.enable_expert_parallel and config.expert_placement:
        from pagoda.distributed.expert_placement import ExpertPlacement

        placement = ExpertPlacement.load(config.expert_placement)
    parallel_state.set_expert_parallel(config.enable_expert_parallel, placement)
    return control


def destroy_parallel_state() -> None:
    """Leave the process group and free its backends now, while the interpreter is whole.

    A gloo group's worker threads can be left holding the last reference to a finished collective's
    tensors; dropping them needs the GIL, and a thread that asks for it once the interpreter has begun
    to exit aborts the process ("terminate called without an active exception": under torchrun 1 run
    in 20-40 of ``pagoda generate``, and 7 in 20 of a 30-line script that all-reduces temporaries).
    ``destroy_process_group`` only unregisters the groups: their threads stop when the last Python
    reference goes (torch releases the GIL to join them). So the parallel state lets go of its groups
    here, callers let go of theirs first (``ControlChannel.close``), and a collection frees the rest."""
    parallel_state.reset_parallel_state()
    if dist.is_available() and dist.is_initialized():
        try:
            backend = str(dist.get_backend())
        except Exception:
            backend = ""
        if "nccl" in backend:
            # NCCL's orderly teardown can block when the peers have already left (seen on H200s at
            # the end of a TP=2 benchmark: the process hung after its results were written); the
            # run is over, so release the communicators without a collective.
            abort_parallel_state()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group (a peer died) may fail to tear down; it is gone anyway
                pass
    gc.collect()  # (the groups' last references can sit in reference cycles)


def abort_parallel_state() -> None:
    """Make collectives blocked on a dead peer return (NCCL does not notice dead peers by itself)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        try:
            abort()
        except Exception:
            pass


def rank_device(platform: Platform, info: RankInfo) -> torch.device:
    platform.set_device(info.local_rank)
    return platform.device(info.local_rank)
