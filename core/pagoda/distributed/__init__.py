"""Tensor/expert parallel groups. Until a distributed run initialises them, size 1."""

from pagoda.distributed.parallel_state import (
    get_tp_group,
    get_tp_rank,
    get_tp_size,
    tensor_parallel_all_gather,
    tensor_parallel_all_reduce,
)

__all__ = ["get_tp_group", "get_tp_rank", "get_tp_size", "tensor_parallel_all_gather",
           "tensor_parallel_all_reduce"]
