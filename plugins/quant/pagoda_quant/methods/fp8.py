"""FP8 W8A8 linear methods: online quantization, per-tensor and block-scaled checkpoints.

Activations are quantized at run time: per token (dynamic, the default), per token and
128-column group (block-scaled weights, as DeepSeek-V3 was trained), or with a static
per-tensor ``input_scale`` from the checkpoint (``activation_scheme: static``).
"""

from __future__ import annotations

import torch
from pagoda.errors import ModelLoadError

from pagoda_quant.formats import fp8 as f8
from pagoda_quant.methods.base import (
    FullPrecisionWeights,
    PolicyConfig,
    QuantizedLinearMethod,
    add_param,
    layer_name,
    op,
    replace_param,
)


class Fp8OnlineMethod(FullPrecisionWeights):
    """Loads the full-precision weight, then stores it as fp8 [N, K] with one scale per
    output channel (``per_channel``) or one for the whole weight."""

    method_name = "fp8"

    def __init__(self, per_channel: bool = True):
        self.per_channel = per_channel

    def process_weights_after_loading(self, layer):
        w = layer.weight.data
        if self.per_channel:
            q, scale = f8.quantize_per_channel(w)
        else:
            q, scale = f8.quantize_per_tensor(w)
            scale = scale.expand(w.shape[0]).contiguous()
        replace_param(layer, "weight", q)
        replace_param(layer, "weight_scale", scale)

    def apply(self, layer, x, bias):
        return op("fp8_linear")(x, layer.weight, layer.weight_scale, None, bias)

    def dequantize(self, layer):
        return layer.weight.float() * layer.weight_scale.float()[:, None]


class Fp8TensorCheckpointMethod(QuantizedLinearMethod):
    """Per-tensor FP8 checkpoints: ``weight`` fp8 [N, K] and ``weight_scale`` float32 (one per
    checkpoint tensor, so a fused qkv holds three); ``input_scale`` too when static."""

    method_name = "fp8"

    def __init__(self, static_activations: bool):
        self.static = static_activations

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        pieces = len(output_sizes)
        add_param(layer, "weight", (sum(output_sizes), input_size), f8.FP8_DTYPE, output_dim=0, input_dim=1)
        add_param(layer, "weight_scale", (pieces,), torch.float32, per_shard=True)
        if self.static:
            add_param(layer, "input_scale", (pieces,), torch.float32, per_shard=True)
        self.output_sizes = list(output_sizes)

    def process_weights_after_loading(self, layer):
        # each piece keeps its own scale: expand to one scale per output channel
        sizes = torch.tensor(self.output_sizes, device=layer.weight_scale.device)
        channel = torch.repeat_interleave(layer.weight_scale.data.float(), sizes)
        replace_param(layer, "weight_scale", channel)
        if self.static:
            # one activation scale for the fused matmul: the largest piece's (no overflow)
            replace_param(layer, "input_scale", layer.input_scale.data.float().amax())

    def apply(self, layer, x, bias):
        return op("fp8_linear")(x, layer.weight, layer.weight_scale, getattr(layer, "input_scale", None), bias)

    def dequantize(self, layer):
        return layer.weight.float() * layer.weight_scale.float()[:, None]


class Fp8BlockMethod(QuantizedLinearMethod):
    """Block-scaled FP8 (DeepSeek-V3): fp8 [N, K] with ``weight_scale_inv`` float32
    [ceil(N/bn), ceil(K/bk)]. ``online`` quantizes a full-precision checkpoint the same way."""

    method_name = "fp8-block"

    def __init__(self, block: tuple[int, int], online: bool):
        self.block = block
        self.online = online

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        bn, bk = self.block
        if len(output_sizes) > 1 and any(s % bn for s in output_sizes):
            raise ModelLoadError(f"{layer_name(layer)}: fused pieces of sizes {output_sizes} are not multiples of "
                                 f"weight_block_size[0]={bn}; block-scaled FP8 needs whole blocks per piece")
        parallel = getattr(layer, "parallel", None)
        split_badly = (parallel == "row" and input_size % bk) or (parallel == "column" and sum(output_sizes) % bn)
        if getattr(layer, "tp_size", 1) > 1 and split_badly:
            raise ModelLoadError(f"{layer_name(layer)}: the per-rank shard [{sum(output_sizes)}, {input_size}] is "
                                 f"not a whole number of {bn}x{bk} blocks; use another tensor_parallel_size")
        n = sum(output_sizes)
        if self.online:
            add_param(layer, "weight", (n, input_size), params_dtype, output_dim=0, input_dim=1)
            return
        add_param(layer, "weight", (n, input_size), f8.FP8_DTYPE, output_dim=0, input_dim=1)
        rows = sum(-(-s // bn) for s in output_sizes)
        add_param(layer, "weight_scale_inv", (rows, -(-input_size // bk)), torch.float32,
                  output_dim=0, input_dim=1, packed_dim=0, packed_factor=bn)

    def process_weights_after_loading(self, layer):
        if self.online:
            q, scale = f8.quantize_blockwise(layer.weight.data, self.block)
            replace_param(layer, "weight", q)
            replace_param(layer, "weight_scale_inv", scale)

    def apply(self, layer, x, bias):
        return op("fp8_block_linear")(x, layer.weight, layer.weight_scale_inv, self.block, bias)

    def dequantize(self, layer):
        return f8.dequantize_blockwise(layer.weight, layer.weight_scale_inv, self.block)


class Fp8Config(PolicyConfig):
    """``quant_method: fp8`` checkpoints, or ``quantization: fp8`` (online) from the user."""

    name = "fp8"

    def __init__(self, checkpoint: bool, block: tuple[int, int] | None = None, static_activations: bool = False,
                 per_channel: bool = True, skip_modules: list[str] | None = None,
                 skip_key: str = "modules_to_not_convert"):
        super().__init__(skip_modules, skip_key)
        self.checkpoint = checkpoint
        self.block = block
        self.static = static_activations
        self.per_channel = per_channel

    def linear_method(self, layer, prefix):
        if self.block is not None:
            return Fp8BlockMethod(self.block, online=not self.checkpoint)
        if self.checkpoint:
            return Fp8TensorCheckpointMethod(self.static)
        return Fp8OnlineMethod(self.per_channel)

    def moe_method(self, layer, prefix):
        from pagoda_quant.methods.moe import Fp8ExpertsMethod

        if self.checkpoint:
            return Fp8ExpertsMethod(block=self.block, online=False, static_activations=self.static)
        return Fp8ExpertsMethod(block=self.block, online=True)

    def describe(self) -> str:
        if self.block is not None:
            return f"fp8 block {self.block[0]}x{self.block[1]} ({'checkpoint' if self.checkpoint else 'online'})"
        if self.checkpoint:
            return f"fp8 per-tensor checkpoint ({'static' if self.static else 'dynamic'} activations)"
        return f"fp8 per-{'channel' if self.per_channel else 'tensor'} weights, per-token activations"
