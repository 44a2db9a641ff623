"""RMSNorm and fused residual-add + RMSNorm in one pass over each row.

Matches ``pagoda.kernels.reference`` rounding: the residual sum is rounded to the
activation dtype before the norm reads it, the normalised value is rounded before the
weight multiplies it, and the variance is computed in float32. The ``*_offset`` variants
(Gemma's ``(1 + w)``, GPT-OSS's float32 weights) multiply by ``offset + w`` in float32 and round once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_cuda._triton import next_pow2, pdl, wait_for_inputs


@triton.jit
def _rms_norm_kernel(x_ptr, x_stride, res_ptr, res_stride, w_ptr, out_ptr, out_stride, sum_ptr,
                     sum_stride, n_rows, H, eps, offset,
                     HAS_RES: tl.constexpr, OFFSET: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                     PDL: tl.constexpr):
    # One program normalises BLOCK_R rows of H values (BLOCK_H = next power of two >= H).
    wait_for_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols[None, :] < H)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + rows64[:, None] * res_stride + cols[None, :], mask=mask, other=0.0)
        s = (x + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows64[:, None] * sum_stride + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=1) / H
    inv = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    if OFFSET:  # (offset + w) multiplies the float32 normalised value: one rounding at the store
        y = (x * inv[:, None]) * (offset + w)[None, :]
    else:  # the reference rounds x * rsqrt to the input dtype before the weight multiplies it
        normed = (x * inv[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = normed * w[None, :]
    tl.store(out_ptr + rows64[:, None] * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D view [rows, H] whose last dimension is contiguous."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            offset: float | None = None):
    shape = x.shape
    x2 = _rows(x)
    n, h = x2.shape
    out_dtype = x.dtype if offset is not None else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((n, h), dtype=out_dtype, device=x.device)
    block_h = next_pow2(h)
    # several short rows per program (q/k norms over head_dim), one long row otherwise
    block_r = max(1, min(16, 2048 // block_h))
    num_warps = 4 if block_h <= 2048 else 8 if block_h <= 8192 else 16
    grid = (triton.cdiv(n, block_r),)
    early = pdl(x.device)
    if residual is None:
        _rms_norm_kernel[grid](x2, x2.stride(0), x2, 0, weight, out, out.stride(0), out, 0, n, h, eps,
                               float(offset or 0.0), HAS_RES=False, OFFSET=offset is not None, BLOCK_R=block_r,
                               BLOCK_H=block_h, PDL=early, num_warps=num_warps, launch_pdl=early)
        return out.view(shape), None
    r2 = _rows(residual)
    summed = torch.empty((n, h), dtype=x.dtype, device=x.device)
    _rms_norm_kernel[grid](x2, x2.stride(0), r2, r2.stride(0), weight, out, out.stride(0), summed,
                           summed.stride(0), n, h, eps, float(offset or 0.0),
                           HAS_RES=True, OFFSET=offset is not None, BLOCK_R=block_r, BLOCK_H=block_h,
                           PDL=early, num_warps=num_warps, launch_pdl=early)
    return out.view(shape), summed.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H]."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), one read of each input."""
    return _launch(x, residual, weight, eps)


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H] = round(normalised x * (offset + w)) (float32 inside)."""
    return _launch(x, None, weight, eps, offset)[0]


def fused_add_rms_norm_offset(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_offset(x + residual), x + residual), one read of each input."""
    return _launch(x, residual, weight, eps, offset)
