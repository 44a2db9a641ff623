"""Small helpers shared by the Triton kernels (imports triton); ``interpreting`` comes from the core."""

from __future__ import annotations

import triton
from pagoda.kernels.triton_support import interpreting, prepare_interpreter

__all__ = ["interpreting", "next_pow2", "sm_count"]

prepare_interpreter()


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


_SM_COUNT: dict[int, int] = {}


def sm_count(device) -> int:
    """Multiprocessors of a CUDA device (132 on an H200); a nominal 132 elsewhere."""
    import torch

    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]
