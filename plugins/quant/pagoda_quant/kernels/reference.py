"""Torch reference of pagoda-quant's kernel ops: correct on any device, the floor.

They compute what the fused kernels compute, with the same rounding points: activations
are quantized to fp8 exactly as the GPU kernels do, products are summed in float32, and
the result is cast to the activation dtype once at the end. Shapes: x [T, K] (T tokens,
K inputs), weights for N outputs.

ops:
  fp8_linear(x, weight, weight_scale, input_scale=None, bias=None) -> [T, N]
      W8A8: weight fp8 [N, K] with weight_scale float32 [N] (per output channel; a
      per-tensor scale is expanded); activations quantized per token (input_scale None)
      or with a static per-tensor input_scale float32 [].
  fp8_block_linear(x, weight, weight_scale_inv, block_size, bias=None) -> [T, N]
      DeepSeek-V3 block FP8: weight fp8 [N, K], weight_scale_inv float32
      [ceil(N/bn), ceil(K/bk)] for block_size (bn, bk); activations quantized per token and
      per bk input columns.
  int4_linear(x, qweight, scales, zeros, bias=None) -> [T, N]
      W4A16: pagoda's packed layout (see pagoda_quant.formats.int4): qweight int32 [K/8, N],
      scales and zeros [K/G, N] in the activation dtype.
  fused_moe_quant(hidden, w13, w2, topk_weights, topk_ids, activation="silu") -> [T, H]
      the core ``fused_moe`` contract with quantized expert weights: w13 and w2 are
      ``ExpertWeights`` (pagoda_quant.methods.moe) that dequantize experts on demand.
"""

from __future__ import annotations

import torch

from pagoda_quant.formats import fp8 as f8
from pagoda_quant.formats.int4 import dequantize_packed


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    x2 = _flat(x)
    if input_scale is None:
        xq, xs = f8.quantize_per_token(x2)
    else:
        xs = input_scale.float().reshape(1, 1)
        xq = f8.cast_to_fp8(x2, xs)
    acc = xq.float() @ weight.float().t()  # exact products, float32 sums (as the tensor cores)
    return _finish(acc * xs * weight_scale.float().reshape(1, -1), x, bias)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     block_size: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    x2 = _flat(x)
    bn, bk = block_size
    xq, xs = f8.quantize_per_token_group(x2, bk)
    a = f8.dequantize_per_group(xq, xs, bk)
    w = f8.dequantize_blockwise(weight, weight_scale_inv, (bn, bk))
    return _finish(a @ w.t(), x, bias)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    x2 = _flat(x)
    w = dequantize_packed(qweight, scales, zeros, dtype=x.dtype)  # [K, N], rounded like the kernel
    out = x2.float() @ w.float()
    return _finish(out, x, bias)


def fused_moe_quant(hidden: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    activation: str = "silu") -> torch.Tensor:
    """The core ``fused_moe`` with ``ExpertWeights`` (pagoda_quant.methods.moe) in place of the
    stacked weight tensors: tokens are grouped by expert and only the experts in use are
    dequantized, one at a time, so no full-precision copy of all experts exists. Ids outside
    [0, E) (experts of other expert-parallel ranks) contribute nothing."""
    from pagoda.kernels.reference import grouped_experts

    return grouped_experts(hidden, topk_weights, topk_ids, w13.num_experts, activation,
                           lambda e: (w13.dequantize(e, hidden.dtype), w2.dequantize(e, hidden.dtype)))


OPS = ("fp8_linear", "fp8_block_linear", "int4_linear", "fused_moe_quant")
