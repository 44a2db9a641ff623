"""Quantized MoE experts (FusedMoE's ``quant_method`` seam): FP8 and INT4.

Parameters follow FusedMoE's naming (``w13_*`` gate+up of every local expert, ``w2_*`` down),
so checkpoint names like ``experts.3.gate_proj.weight_scale_inv`` reach them:

  fp8 online / per-tensor checkpoint:  w13_weight fp8 [E, 2I, H], w2_weight fp8 [E, H, I] with
      w13_weight_scale [E, 2I] and w2_weight_scale [E, H] (one scale per output channel; a
      per-tensor checkpoint's [E, 2] / [E] scales are expanded after loading)
  fp8 block (DeepSeek-V3):  w13_weight_scale_inv [E, 2I/bn, H/bk], w2_weight_scale_inv [E, H/bn, I/bk]
  int4 online (round-to-nearest):  w13_qweight int32 [E, H/8, 2I], w13_scales/w13_zeros [E, H/G, 2I],
      w2_qweight [E, I/8, H], w2_scales/w2_zeros [E, I/G, H] (pagoda's kernel layout per expert)

Experts compute weight-only (W8A16 / W4A16): each used expert's weights are dequantized to
the activation dtype and multiplied like the core ``fused_moe`` op does, so routed tokens never
go through a second activation rounding. The ``fused_moe_quant`` op does this per used expert
(reference) or for all experts at once followed by the platform's ``fused_moe`` (CUDA).
"""

from __future__ import annotations

import torch
from pagoda.errors import ModelLoadError
from pagoda.layers.moe import FusedMoEMethod
from torch import nn

from pagoda_quant.formats import fp8 as f8
from pagoda_quant.formats import int4 as i4
from pagoda_quant.methods.base import add_param, check_group_size, layer_name, op, replace_param

# weight formats of ExpertWeights.kernel_tensors(), read by the Triton MoE kernels
FP8_CHANNEL, FP8_BLOCK, INT4 = 0, 1, 2


class ExpertWeights:
    """One projection ("w13" or "w2") of a layer's local experts, dequantized on demand."""

    def __init__(self, layer: nn.Module, method: QuantizedExpertsMethod, which: str):
        self.layer, self.method, self.which = layer, method, which
        self.num_experts = layer.num_local_experts

    @property
    def in_features(self) -> int:
        """Input size per expert (H for w13, the intermediate size for w2)."""
        return self.method.in_features(self.layer, self.which)

    def kernel_tensors(self) -> tuple:
        """(format, weight, scales, zeros or None, (block_n, block_k), group) for fused kernels."""
        return self.method.kernel_tensors(self.layer, self.which)

    def dequantize(self, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, cols] (out x in) of one expert in ``dtype``."""
        return self.method.dequantize_expert(self.layer, self.which, expert).to(dtype)

    def dequantize_all(self, dtype: torch.dtype) -> torch.Tensor:
        """[E, rows, cols] in ``dtype`` (the CUDA path, ahead of the dense fused_moe kernel)."""
        return self.method.dequantize_all(self.layer, self.which).to(dtype)


class QuantizedExpertsMethod(FusedMoEMethod):
    method_name = ""

    def apply(self, layer, x, topk_weights, topk_ids):
        return op("fused_moe_quant")(x, ExpertWeights(layer, self, "w13"), ExpertWeights(layer, self, "w2"),
                                     topk_weights, topk_ids, layer.activation)

    def dequantize_expert(self, layer, which: str, expert: int) -> torch.Tensor:
        raise NotImplementedError

    def dequantize_all(self, layer, which: str) -> torch.Tensor:
        return torch.stack([self.dequantize_expert(layer, which, e) for e in range(layer.num_local_experts)])

    def weight_bytes(self, layer) -> int:
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))


def _full_precision(layer, num_experts, hidden, inter, dtype) -> None:
    add_param(layer, "w13_weight", (num_experts, 2 * inter, hidden), dtype)
    add_param(layer, "w2_weight", (num_experts, hidden, inter), dtype)


class Fp8ExpertsMethod(QuantizedExpertsMethod):
    method_name = "fp8"

    def __init__(self, block: tuple[int, int] | None, online: bool, static_activations: bool = False):
        self.block = block
        self.online = online
        self.static = static_activations  # the checkpoint has input scales (unused: experts are W8A16)

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype):
        inter = intermediate_size_per_partition
        if self.online:
            _full_precision(layer, num_experts, hidden_size, inter, params_dtype)
            return
        add_param(layer, "w13_weight", (num_experts, 2 * inter, hidden_size), f8.FP8_DTYPE)
        add_param(layer, "w2_weight", (num_experts, hidden_size, inter), f8.FP8_DTYPE)
        if self.block is not None:
            bn, bk = self.block
            if inter % bn or inter % bk:
                raise ModelLoadError(f"{layer_name(layer)}: expert intermediate size {inter} per rank is not a "
                                     f"multiple of weight_block_size {list(self.block)}")
            add_param(layer, "w13_weight_scale_inv", (num_experts, 2 * inter // bn, -(-hidden_size // bk)),
                      torch.float32)
            add_param(layer, "w2_weight_scale_inv", (num_experts, -(-hidden_size // bn), inter // bk), torch.float32)
            return
        # per-tensor checkpoint: one scale per expert tensor (gate, up | down)
        add_param(layer, "w13_weight_scale", (num_experts, 2), torch.float32, weight_loader=self._scale_loader(layer))
        add_param(layer, "w2_weight_scale", (num_experts,), torch.float32, weight_loader=self._scale_loader(layer))
        if self.static:
            add_param(layer, "w13_input_scale", (num_experts, 2), torch.float32,
                      weight_loader=self._scale_loader(layer))
            add_param(layer, "w2_input_scale", (num_experts,), torch.float32, weight_loader=self._scale_loader(layer))

    @staticmethod
    def _scale_loader(layer):
        def load(param, loaded, shard_id, expert_id):
            if expert_id is None:
                raise ModelLoadError(f"{layer_name(layer)}: stacked per-tensor FP8 expert scales are not supported")
            shard = getattr(layer, "expert_shard", None)  # expert parallelism: which slot holds it
            local = shard.slot_of(expert_id) if shard is not None else expert_id
            if local is None or not 0 <= local < layer.num_local_experts:
                return  # held by another expert-parallel rank
            target = param.data[local]
            if shard_id in ("w1", "w3"):
                target = target[0 if shard_id == "w1" else 1]
            target.copy_(loaded.reshape(()))

        return load

    def process_weights_after_loading(self, layer):
        for which in ("w13", "w2"):
            w = getattr(layer, f"{which}_weight").data
            if self.online and self.block is None:
                q, scale = f8.quantize_per_channel(w)  # [E, rows, cols] -> scale [E, rows]
                replace_param(layer, f"{which}_weight", q)
                replace_param(layer, f"{which}_weight_scale", scale)
            elif self.online:
                pairs = [f8.quantize_blockwise(w[e], self.block) for e in range(w.shape[0])]
                replace_param(layer, f"{which}_weight", torch.stack([p[0] for p in pairs]))
                replace_param(layer, f"{which}_weight_scale_inv", torch.stack([p[1] for p in pairs]))
            elif self.block is None:
                if self.static:
                    del layer._parameters[f"{which}_input_scale"]
                scale = getattr(layer, f"{which}_weight_scale").data
                rows = w.shape[1]
                channel = scale.repeat_interleave(rows // 2, dim=1) if which == "w13" else \
                    scale[:, None].expand(-1, rows)
                replace_param(layer, f"{which}_weight_scale", channel.contiguous())

    def in_features(self, layer, which):
        return getattr(layer, f"{which}_weight").shape[2]

    def kernel_tensors(self, layer, which):
        w = getattr(layer, f"{which}_weight")
        if self.block is not None:
            return FP8_BLOCK, w, getattr(layer, f"{which}_weight_scale_inv"), None, self.block, 1
        return FP8_CHANNEL, w, getattr(layer, f"{which}_weight_scale"), None, (1, 1), 1

    def dequantize_expert(self, layer, which, expert):
        w = getattr(layer, f"{which}_weight")[expert]
        if self.block is not None:
            return f8.dequantize_blockwise(w, getattr(layer, f"{which}_weight_scale_inv")[expert], self.block)
        return w.float() * getattr(layer, f"{which}_weight_scale")[expert].float()[:, None]

    def dequantize_all(self, layer, which):
        w = getattr(layer, f"{which}_weight")
        if self.block is not None:
            return super().dequantize_all(layer, which)
        return w.float() * getattr(layer, f"{which}_weight_scale").float()[..., None]


class Int4ExpertsMethod(QuantizedExpertsMethod):
    method_name = "int4"

    def __init__(self, group_size: int, symmetric: bool):
        self.group_size = group_size
        self.symmetric = symmetric

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype):
        self.groups = {which: check_group_size(layer, k, self.group_size, "quantization int4 (experts)")
                       for which, k in (("w13", hidden_size), ("w2", intermediate_size_per_partition))}
        _full_precision(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype)

    def process_weights_after_loading(self, layer):
        for which in ("w13", "w2"):
            w = getattr(layer, f"{which}_weight").data  # [E, N, K]
            g = self.groups[which]
            packed = [i4.to_kernel_layout(*i4.quantize_groups(w[e], g, self.symmetric), w.dtype)
                      for e in range(w.shape[0])]
            del layer._parameters[f"{which}_weight"]
            for i, name in enumerate(("qweight", "scales", "zeros")):
                replace_param(layer, f"{which}_{name}", torch.stack([p[i] for p in packed]))

    def in_features(self, layer, which):
        return getattr(layer, f"{which}_qweight").shape[1] * i4.PACK

    def kernel_tensors(self, layer, which):
        qweight, scales, zeros = (getattr(layer, f"{which}_{n}") for n in ("qweight", "scales", "zeros"))
        return INT4, qweight, scales, zeros, (1, 1), self.groups[which]

    def dequantize_expert(self, layer, which, expert):
        qweight, scales, zeros = (getattr(layer, f"{which}_{n}")[expert] for n in ("qweight", "scales", "zeros"))
        return i4.dequantize_packed(qweight, scales, zeros, torch.float32).t()

    def dequantize_all(self, layer, which):
        qweight, scales, zeros = (getattr(layer, f"{which}_{n}") for n in ("qweight", "scales", "zeros"))
        e, k8, n = qweight.shape
        q = i4.unpack_rows(qweight.reshape(e * k8, n)).reshape(e, k8 * 8, n).float()  # [E, K, N]
        g = k8 * 8 // scales.shape[1]
        w = (q.view(e, -1, g, n) - zeros.float()[:, :, None]) * scales.float()[:, :, None]
        return w.reshape(e, k8 * 8, n).transpose(1, 2)
