"""The ``cuda`` implementations of pagoda-quant's ops: which GPU path runs for which shape.

  fp8_linear        cuBLASLt through ``torch._scaled_mm`` with row-wise scales (Hopper and
                    later, bf16 output), else the Triton GEMM; activations quantized by Triton.
  fp8_block_linear  Triton per-token-group quantization + Triton block-scaled GEMM.
  int4_linear       Triton fused dequantize-GEMM up to INT4_DENSE_MIN_TOKENS rows (split-K,
                    autotuned per shape and batch bucket on its first call, which the engine
                    makes eagerly before capturing a decode graph); above it one Triton
                    dequantization to the activation dtype plus a dense matmul (prefill is
                    compute-bound, so the dense tensor-core GEMM wins there).
  fused_moe_quant   Triton fused MoE dequantizing expert weight tiles in registers.

``PAGODA_QUANT_FP8_GEMM=triton`` forces the Triton FP8 GEMM (benchmarks compare both);
``PAGODA_QUANT_INT4_AUTOTUNE=0`` gives the INT4 GEMM a fixed configuration instead. All
paths are CUDA-graph safe: no host synchronisation and no data-dependent Python branches.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from pagoda_cuda.quant import fp8 as triton_fp8
from pagoda_cuda.quant import int4 as triton_int4

logger = logging.getLogger("pagoda.quant")
INT4_DENSE_MIN_TOKENS = int(os.environ.get("PAGODA_QUANT_INT4_DENSE_MIN_TOKENS", "256"))
_scaled_mm_state: dict[str, bool] = {}


def _flat(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _use_scaled_mm(x: torch.Tensor, n: int, k: int) -> bool:
    if os.environ.get("PAGODA_QUANT_FP8_GEMM", "auto") == "triton" or _scaled_mm_state.get("broken"):
        return False
    if x.dtype != torch.bfloat16 or n % 16 or k % 16 or not hasattr(torch, "_scaled_mm"):
        return False
    return _capability(x.device) >= (9, 0)  # row-wise scaled FP8 GEMMs: Hopper and later


def fp8_linear(x, weight, weight_scale, input_scale=None, bias=None):
    x2 = _flat(x)
    n, k = weight.shape
    if input_scale is None:
        xq, xs = triton_fp8.quantize_fp8_groups(x2, k)
    else:
        xs = input_scale.float().reshape(1, 1)
        xq = (x2.float() / xs).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    out = None
    if _use_scaled_mm(x2, n, k):
        try:
            scale_a = xs.expand(x2.shape[0], 1).contiguous() if xs.shape[0] != x2.shape[0] else xs
            out = torch._scaled_mm(xq, weight.t(), scale_a=scale_a, scale_b=weight_scale.view(1, -1),
                                   bias=bias, out_dtype=x.dtype)
        except (RuntimeError, TypeError) as exc:  # an older GPU/torch without row-wise scaling
            _scaled_mm_state["broken"] = True
            logger.warning("torch._scaled_mm with row-wise scales failed (%s); using the Triton FP8 GEMM", exc)
    if out is None:
        out = triton_fp8.fp8_gemm(xq, xs, weight, weight_scale, bias, x.dtype)
    return out.reshape(*x.shape[:-1], n)


def fp8_block_linear(x, weight, weight_scale_inv, block_size, bias=None):
    x2 = _flat(x)
    bn, bk = block_size
    xq, xs = triton_fp8.quantize_fp8_groups(x2, bk)
    out = triton_fp8.fp8_block_gemm(xq, xs, weight, weight_scale_inv, (bn, bk), bias, x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def int4_linear(x, qweight, scales, zeros, bias=None):
    x2 = _flat(x)
    n = qweight.shape[1]
    if x2.shape[0] >= INT4_DENSE_MIN_TOKENS:
        w = triton_int4.int4_dequantize(qweight, scales, zeros).to(x.dtype)
        out = torch.nn.functional.linear(x2, w.t(), bias)
    else:
        out = triton_int4.int4_gemm(x2, qweight, scales, zeros, bias)
    return out.reshape(*x.shape[:-1], n)


def fused_moe_quant(hidden, w13, w2, topk_weights, topk_ids, activation="silu"):
    """pagoda-quant's expert formats: the Triton fused MoE dequantizing weight tiles in registers.
    Experts of another method (no ``kernel_tensors``): every local expert dequantized to the
    activation dtype, then the platform's dense ``fused_moe`` (a transient copy of one layer)."""
    if hasattr(w13, "kernel_tensors") and hasattr(w2, "kernel_tensors"):
        from pagoda_cuda.quant import moe as triton_moe

        return triton_moe.fused_moe_quant(hidden.contiguous(), w13, w2, topk_weights, topk_ids, activation)
    from pagoda.kernels import get_op

    return get_op("fused_moe")(hidden, w13.dequantize_all(hidden.dtype), w2.dequantize_all(hidden.dtype),
                               topk_weights, topk_ids, activation)
