"""Gated activations ``act(x[:, :I]) * x[:, I:]`` in one pass.

Rounding matches the torch reference: the activation is rounded to the input dtype
before the multiply (torch's silu/gelu return the input dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_cuda._triton import gelu_tanh, pdl, silu, wait_for_inputs

BLOCK = 1024


@triton.jit
def _gated_kernel(x_ptr, x_stride, out_ptr, out_stride, inner, ACT: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inner + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == "silu":
        act = silu(gate)
    else:
        act = gelu_tanh(gate)
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _gated(x: torch.Tensor, act: str) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n, width = x2.shape
    inner = width // 2
    out = torch.empty((n, inner), dtype=x.dtype, device=x.device)
    if n:
        grid = (n, triton.cdiv(inner, BLOCK))
        early = pdl(x.device)
        _gated_kernel[grid](x2, x2.stride(0), out, out.stride(0), inner, ACT=act, BLOCK=BLOCK, PDL=early,
                            num_warps=4, launch_pdl=early)
    return out.view(*shape[:-1], inner)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:]."""
    return _gated(x, "silu")


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> gelutanh(x[:, :I]) * x[:, I:]."""
    return _gated(x, "gelu")
