"""Grammar masks on CUDA logits (the kernel op ``apply_token_bitmask``): xgrammar's own Triton kernel, launched
here without its wrapper's work per call. ``xgrammar.apply_token_bitmask_inplace`` asks the device for its
properties twice and copies the row index (``torch.tensor`` of a tensor) on every call, on the host's path of
every constrained step (a server step at 64 rows is bound by host work: docs/benchmarks.md); the kernel,
its arguments and its result are the library's.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 4096  # ids per program iteration, as xgrammar's wrapper launches it
_SMS: dict[int | None, int] = {}  # device index -> multiprocessors (the kernel's persistent grid)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, vocab_size: int) -> None:
    """``logits`` [B, V] float, ``bitmask`` [B', W] int32 (row r masks logits row r), ``rows`` int32 [R] on the
    device: set ``logits[r, t]`` to -inf for each r in ``rows`` and t < ``vocab_size`` whose bit is 0."""
    from xgrammar.kernels.apply_token_bitmask_inplace_triton import apply_token_bitmask_inplace_kernel

    assert bitmask.dtype == torch.int32 and vocab_size <= min(logits.shape[-1], 32 * bitmask.shape[-1])
    sms = _SMS.get(logits.device.index)
    if sms is None:  # (a CPU tensor: the Triton interpreter, tests)
        on_gpu = logits.device.type == "cuda"
        sms = _SMS[logits.device.index] = torch.cuda.get_device_properties(logits.device).multi_processor_count \
            if on_gpu else 4
    apply_token_bitmask_inplace_kernel[(sms,)](
        logits, bitmask, rows, rows.shape[0], vocab_size, logits.stride(0), bitmask.stride(0), sms, BLOCK_SIZE,
        num_warps=BLOCK_SIZE // 32 // (16 // logits.element_size()), num_stages=3)
