"""The parallel state of this process: its tensor-parallel group and its expert-parallel shard.

Layers read it while they are built (how much of a weight this rank holds) and while they
run (which group to all-reduce over). Rank 0 of 1 until a distributed run sets it
(``pagoda.distributed.process_group.init_parallel_state``); it is reset when that run ends.

Tensor parallelism spans every rank of the run (``tensor_parallel_size`` == world size).
Expert parallelism, when enabled, uses the same ranks: MoE layers hold a subset of the
experts (``expert_placement``) instead of a slice of every expert.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_TP_GROUP: Any = None
_TP_RANK = 0
_TP_SIZE = 1
_EXPERT_PARALLEL = False
_EXPERT_PLACEMENT: Any = None  # pagoda.distributed.expert_placement.ExpertPlacement or None (contiguous)
# pipeline parallelism (pagoda.distributed.pipeline_parallel): this rank's stage, the number of
# stages, the global ranks of the same tensor-parallel slot in the previous/next stage, and the
# layers of every stage as (start, end)
_PP_STAGE = 0
_PP_SIZE = 1
_PP_PEERS: tuple[int | None, int | None, int | None] = (None, None, None)  # (previous, next, first stage's)
_PP_RANGES: list[tuple[int, int]] | None = None


def set_tp_group(group: Any, rank: int, size: int) -> None:
    global _TP_GROUP, _TP_RANK, _TP_SIZE
    _TP_GROUP, _TP_RANK, _TP_SIZE = group, rank, size


def set_expert_parallel(enabled: bool, placement: Any = None) -> None:
    """Split MoE experts over the tensor-parallel ranks; ``placement`` says which rank holds
    which experts (None: equal contiguous blocks)."""
    global _EXPERT_PARALLEL, _EXPERT_PLACEMENT
    _EXPERT_PARALLEL, _EXPERT_PLACEMENT = enabled, placement


def set_pipeline_stage(stage: int, size: int, peers: tuple, ranges: list[tuple[int, int]] | None) -> None:
    global _PP_STAGE, _PP_SIZE, _PP_PEERS, _PP_RANGES
    _PP_STAGE, _PP_SIZE, _PP_PEERS, _PP_RANGES = stage, size, peers, ranges


def get_pipeline_stage() -> tuple[int, int, tuple, list[tuple[int, int]] | None]:
    """(stage, number of stages, (previous, next, first stage's) peer ranks, layer ranges)."""
    return _PP_STAGE, _PP_SIZE, _PP_PEERS, _PP_RANGES


def reset_parallel_state() -> None:
    set_tp_group(None, 0, 1)
    set_expert_parallel(False, None)
    set_pipeline_stage(0, 1, (None, None, None), None)


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """Build a one-device model while a tensor-parallel engine lives in this process: its
    layers see size 1 while they are built, and they gate every collective on that size."""
    saved = (_TP_GROUP, _TP_RANK, _TP_SIZE, _EXPERT_PARALLEL, _EXPERT_PLACEMENT)
    pipeline = get_pipeline_stage()
    reset_parallel_state()
    try:
        yield
    finally:
        set_tp_group(*saved[:3])
        set_expert_parallel(*saved[3:])
        set_pipeline_stage(*pipeline)


def get_tp_group() -> Any:
    return _TP_GROUP


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def expert_parallel_enabled() -> bool:
    """True when MoE layers split their experts over the ranks (and more than one rank runs)."""
    return _EXPERT_PARALLEL and _TP_SIZE > 1


def get_expert_placement() -> Any:
    return _EXPERT_PLACEMENT


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place."""
    if _TP_SIZE == 1:
        return x
    torch.distributed.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    torch.distributed.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)
