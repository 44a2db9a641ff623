"""Small helpers shared by the Triton kernels (imports triton); ``interpreting`` comes from the core."""

from __future__ import annotations

import triton
import triton.language as tl
from pagoda.kernels.triton_support import interpreting, prepare_interpreter
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pagoda_cuda.switches import lenient, pdl_requested

__all__ = ["gelu_tanh", "interpreting", "mma", "next_pow2", "pdl", "silu", "sm_count", "tanh", "to_f16",
           "wait_for_inputs"]

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


PDL_REQUESTED = lenient(pdl_requested, False)  # read at import, as the kernels' other switches
_PDL: dict[int, bool] = {}


def pdl(device) -> bool:
    """Whether the decode path's kernels launch on ``device`` with programmatic dependent launch (PDL):
    ``PAGODA_CUDA_PDL`` not 0, a GPU of compute capability 9.0 or later (Hopper), not the interpreter. Such
    a kernel is started while the kernel before it finishes (its launch and set-up overlap that kernel's
    tail; in a CUDA graph the dependency is a programmatic edge) and waits in ``wait_for_inputs`` before
    it touches memory. Measured faster on an H200 at batch 1 (docs/cuda.md, docs/benchmarks.md)."""
    if not PDL_REQUESTED or device.type != "cuda" or interpreting():
        return False
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PDL:
        _PDL[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _PDL[index]


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """The first statement of a kernel that ``pdl`` may launch early: wait until the kernel before it has
    finished and its writes are visible, then let the next kernel start launching. Nothing without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def tanh(x):
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def silu(x):
    """x * sigmoid(x), float32."""
    return x / (1.0 + tl.exp(-x))


@triton.jit
def gelu_tanh(x):
    """GELU's tanh approximation, float32: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), with
    1 + tanh(t) written as 2 / (1 + exp(-2t)) (one exp, no cancellation)."""
    t = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (2.0 / (1.0 + tl.exp(-2.0 * t)))


@triton.jit
def mma(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """a @ b on the matrix units, float32 accumulation: plain for ``UPCAST`` (the interpreter's
    float32 copies), full float32 precision for ``IEEE`` (float32 models), else ``a`` in ``b``'s
    type (bf16 / fp16 operands)."""
    if UPCAST:
        c = tl.dot(a, b)
    elif IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a.to(b.dtype), b)
    return c


@triton.jit
def to_f16(x):
    """``x`` as fp16, clamped to its range (the fp16 dots over an fp8 KV cache)."""
    return tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
