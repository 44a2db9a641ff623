"""The tensor-parallel group of this process (rank 0 of 1 unless a distributed run set it)."""

from __future__ import annotations

from typing import Any

import torch

_TP_GROUP: Any = None
_TP_RANK = 0
_TP_SIZE = 1


def set_tp_group(group: Any, rank: int, size: int) -> None:
    global _TP_GROUP, _TP_RANK, _TP_SIZE
    _TP_GROUP, _TP_RANK, _TP_SIZE = group, rank, size


def get_tp_group() -> Any:
    return _TP_GROUP


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
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
