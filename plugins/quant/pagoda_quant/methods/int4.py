"""INT4 weight-only (W4A16) linear methods: the shared kernel layout and online
round-to-nearest quantization (``quantization: int4``).

Every INT4 method (RTN, GPTQ, AWQ) ends, after loading, in one layout the kernels read
(pagoda_quant.formats.int4): ``qweight`` int32 [K/8, N], ``scales`` and ``zeros`` [K/G, N]
in the activation dtype, and for GPTQ act-order checkpoints a ``perm`` [K] that reorders
the input columns so that groups are contiguous.
"""

from __future__ import annotations

import torch

from pagoda_quant.formats import int4 as i4
from pagoda_quant.methods.base import (
    FullPrecisionWeights,
    PolicyConfig,
    QuantizedLinearMethod,
    check_group_size,
    op,
    replace_param,
)
from pagoda_quant.methods.moe import Int4ExpertsMethod


class Int4KernelLayout(QuantizedLinearMethod):
    """apply/dequantize over the kernel layout (qweight, scales, zeros, optional perm)."""

    def apply(self, layer, x, bias):
        perm = getattr(layer, "perm", None)
        if perm is not None:
            x = x.index_select(-1, perm)
        return op("int4_linear")(x, layer.qweight, layer.scales, layer.zeros, bias)

    def dequantize(self, layer):
        wt = i4.dequantize_packed(layer.qweight, layer.scales, layer.zeros, torch.float32)  # [K, N] permuted
        perm = getattr(layer, "perm", None)
        if perm is not None:
            wt = torch.empty_like(wt).index_copy_(0, perm, wt)
        return wt.t()

    def install(self, layer, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                perm: torch.Tensor | None = None) -> None:
        replace_param(layer, "qweight", qweight.contiguous())
        replace_param(layer, "scales", scales.contiguous())
        replace_param(layer, "zeros", zeros.contiguous())
        if perm is not None:
            layer.register_buffer("perm", perm, persistent=False)


class Int4RtnMethod(FullPrecisionWeights, Int4KernelLayout):
    """Online group-wise round-to-nearest of a full-precision checkpoint."""

    method_name = "int4"

    def __init__(self, group_size: int, symmetric: bool):
        self.group_size = group_size
        self.symmetric = symmetric

    def check_shape(self, layer, input_size, output_sizes):
        self.group = check_group_size(layer, input_size, self.group_size, "quantization int4")

    def process_weights_after_loading(self, layer):
        w = layer.weight.data
        q, scales, zeros = i4.quantize_groups(w, self.group, self.symmetric)
        dtype = w.dtype if w.dtype.is_floating_point else torch.float16
        qweight, scales, zeros = i4.to_kernel_layout(q, scales, zeros, dtype)
        del layer._parameters["weight"]
        self.install(layer, qweight, scales, zeros)


class Int4Config(PolicyConfig):
    """``quantization: int4`` or ``{method: int4, group_size: 64, symmetric: false}``."""

    name = "int4"

    def __init__(self, group_size: int | None = None, symmetric: bool = False,
                 skip_modules: list[str] | None = None):
        super().__init__(skip_modules)
        self.group_size = group_size
        self.symmetric = symmetric

    def linear_method(self, layer, prefix):
        return Int4RtnMethod(self.group_size, self.symmetric)

    def moe_method(self, layer, prefix):
        return Int4ExpertsMethod(self.group_size, self.symmetric)

    def describe(self) -> str:
        group = "128 (64 or 32 where 128 does not divide)" if self.group_size is None else self.group_size
        return f"int4 round-to-nearest, group {group}, {'symmetric' if self.symmetric else 'zero points'}"
