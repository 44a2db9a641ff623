"""The mixture-of-experts layer: route once for the whole batch, then compute the experts
grouped by expert through the ``fused_moe`` kernel op.

``FusedMoE`` holds every local expert stacked in two tensors, created by a quant method:

    w13_weight [E_local, 2 * I_p, H]   gate rows then up rows of each expert
    w2_weight  [E_local, H, I_p]       down projection of each expert

``I_p`` is the expert intermediate size divided over the tensor-parallel ranks (each rank
holds a column slice of gate/up and the matching row slice of down, and the layer output is
all-reduced). ``E_local`` is the number of experts this rank holds: all of them, unless
expert parallelism (``enable_expert_parallel``) splits the experts over the ranks instead of
slicing each one (then ``I_p`` = I). ``expert_shard`` (``pagoda.distributed.expert_parallel``)
says which global experts the local slots hold and maps the router's global ids to local
slots (-1 for pairs another rank computes, which ``fused_moe`` skips); the layer output is
then this rank's partial sum, all-reduced like the tensor-parallel one.

Checkpoint tensors arrive per expert under HF names (``...experts.{e}.gate_proj.weight``,
``up_proj``, ``down_proj``) or already stacked (``...experts.gate_up_proj`` [E, 2I, H],
``...experts.down_proj`` [E, H, I], transformers 5's in-memory layout);
``expert_params_mapping`` turns them into (parameter, shard, expert) for
``FusedMoE.weight_loader``.

Quantization: ``quant_config.get_moe_method(layer, prefix)`` may return a
``FusedMoEMethod`` subclass that creates other parameters (names starting with ``w13_`` /
``w2_``, so the name mapping reaches them) and applies its own kernels. Parameters a method
creates get ``FusedMoE.weight_loader`` unless the method sets its own ``weight_loader``
with the same signature.

Expert biases (``has_bias``, GPT-OSS): ``w13_bias`` [E_local, 2 * I_p] (this rank's gate then
up slice) and ``w2_bias`` [E_local, H], added to each expert's projections (the down bias by
tensor-parallel rank 0 only, so the all-reduce adds it once). Only quant methods that declare
``supports_bias`` take them.

Each layer adds its per-expert token counts (one per (token, chosen expert) pair, padding
rows of captured graphs excluded) to ``ForwardContext.expert_counts[prefix]``; the engine
sums them per layer for ``LLM.get_stats()["expert_load"]``.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.distributed import get_tp_rank, get_tp_size, tensor_parallel_all_reduce
from pagoda.distributed.expert_parallel import ExpertShard
from pagoda.errors import ModelLoadError
from pagoda.forward_context import get_forward_context
from pagoda.interfaces import QuantConfig
from pagoda.kernels import get_op
from pagoda.layers.linear import check_shape, set_weight_attrs
from pagoda.layers.moe_routing import Routing

# HF hidden_act -> the activation name the fused_moe op takes
MOE_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
                   "swigluoai": "swigluoai"}


def pair_weights(ctx, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """[T * K] long: 1 for each (token, chosen expert) pair, 0 for the padding rows of a
    captured graph (they write to slot -1). Made once per step for every MoE layer: at decode
    sizes each small launch costs more than its work."""
    key = tuple(shape)
    cached = ctx.moe_pair_weights.get(key)
    if cached is None:
        t, k = key
        meta = ctx.attn_metadata
        if meta is not None and meta.for_graph:
            real = (meta.slot_mapping[:t] >= 0).long()
            cached = real.unsqueeze(1).expand(t, k).reshape(-1)
        else:
            cached = torch.ones(t * k, dtype=torch.long, device=device)
        ctx.moe_pair_weights[key] = cached
    return cached


class FusedMoEMethod:
    """How a FusedMoE layer holds and applies its experts' weights (subclass for quantized experts)."""

    supports_bias = False  # whether apply() adds layer.w13_bias / layer.w2_bias

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        pass

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_weights [T, K] float32, topk_ids [T, K] local expert ids -> [T, H]
        (this rank's partial sum when tensor parallel; the layer all-reduces)."""
        raise NotImplementedError


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    """Experts in the model dtype, computed by the selected ``fused_moe`` op."""

    supports_bias = True

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype):
        w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size_per_partition, hidden_size,
                                       dtype=params_dtype), requires_grad=False)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size_per_partition,
                                      dtype=params_dtype), requires_grad=False)
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)

    def apply(self, layer, x, topk_weights, topk_ids):
        if layer.w13_bias is None:
            return get_op("fused_moe")(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.activation)
        return get_op("fused_moe")(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.activation,
                                   w13_bias=layer.w13_bias, w2_bias=layer.w2_bias if layer.moe_tp_rank == 0 else None)


def expert_params_mapping(num_experts: int, gate: str = "gate_proj", up: str = "up_proj",
                          down: str = "down_proj") -> list[tuple[str, str, int | None, str]]:
    """(parameter part, checkpoint part, expert id, shard id) for every HF expert tensor name.

    ``.experts.3.gate_proj.weight`` -> ``.experts.w13_weight`` (shard "w1", expert 3); the
    stacked ``.experts.gate_up_proj`` -> ``.experts.w13_weight`` (shard "w13", all experts). The
    leading dot keeps ``shared_experts.down_proj`` out of it.
    """
    mapping: list[tuple[str, str, int | None, str]] = []
    for e in range(num_experts):
        mapping += [(".experts.w13_", f".experts.{e}.{gate}.", e, "w1"),
                    (".experts.w13_", f".experts.{e}.{up}.", e, "w3"),
                    (".experts.w2_", f".experts.{e}.{down}.", e, "w2")]
    mapping += [(".experts.w13_weight", ".experts.gate_up_proj", None, "w13"),
                (".experts.w2_weight", ".experts.down_proj", None, "w2")]
    return mapping


class FusedMoE(nn.Module):
    """forward(hidden [T, H], router_logits [T, E], correction_bias [E] | None) -> [T, H]."""

    def __init__(self, routing: Routing, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 reduce_results: bool = True, quant_config: QuantConfig | None = None, prefix: str = "",
                 params_dtype: torch.dtype | None = None, has_bias: bool = False):
        super().__init__()
        if activation not in MOE_ACTIVATIONS:
            raise ModelLoadError(f"config hidden_act={activation!r} is not supported for MoE experts "
                                 f"(supported: {', '.join(sorted(MOE_ACTIVATIONS))})")
        self.prefix = prefix
        self.routing = routing
        self.activation = MOE_ACTIVATIONS[activation]
        self.reduce_results = reduce_results
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts = routing.num_experts
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        # Expert parallelism gives each rank whole experts; otherwise every expert is sliced
        # over the tensor-parallel ranks by intermediate size.
        self.expert_shard = ExpertShard.for_layer(prefix, self.num_experts)
        self.num_local_experts = self.expert_shard.num_local
        self.moe_tp_rank, self.moe_tp_size = (0, 1) if self.expert_shard.enabled else (self.tp_rank, self.tp_size)
        if intermediate_size % self.moe_tp_size:
            raise ModelLoadError(f"{prefix}: moe_intermediate_size={intermediate_size} is not divisible by "
                                 f"tensor_parallel_size={self.tp_size} (or enable_expert_parallel)")
        self.intermediate_size_per_partition = intermediate_size // self.moe_tp_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        method = quant_config.get_moe_method(self, prefix) if quant_config is not None else None
        self.quant_method: FusedMoEMethod = method or UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(self, self.num_local_experts, hidden_size,
                                         self.intermediate_size_per_partition, self.params_dtype)
        self.w13_bias = self.w2_bias = None
        if has_bias:
            if not self.quant_method.supports_bias:
                raise ModelLoadError(f"{prefix}: experts with biases are not supported by the quantization method "
                                     f"{type(self.quant_method).__name__}")
            self.w13_bias = nn.Parameter(torch.zeros(self.num_local_experts, 2 * self.intermediate_size_per_partition,
                                                     dtype=self.params_dtype), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.zeros(self.num_local_experts, hidden_size, dtype=self.params_dtype),
                                        requires_grad=False)
        for param in self.parameters(recurse=False):
            if not hasattr(param, "weight_loader"):
                set_weight_attrs(param, weight_loader=self.weight_loader)

    # ------------------------------------------------------------------ loading
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
                      expert_id: int | None) -> None:
        """Copy one checkpoint tensor into this rank's slice of a stacked parameter.

        shard_id "w1" (gate) / "w3" (up): loaded [I, ...] into rows [0, I_p) / [I_p, 2 I_p) of
        ``param[e]`` after taking this rank's I_p rows; "w2" (down): loaded [H, I] into
        ``param[e]`` after taking this rank's I_p columns; "w13" / "w2" with expert_id None:
        a stacked [E, ...] tensor, loaded expert by expert.
        """
        if expert_id is None:
            if loaded.shape[0] != self.num_experts:
                raise ModelLoadError(f"stacked expert tensor has {loaded.shape[0]} experts; config says "
                                     f"{self.num_experts}")
            for e in range(self.num_experts):
                if shard_id == "w13":
                    gate, up = loaded[e].chunk(2, dim=0)
                    self.weight_loader(param, gate, "w1", e)
                    self.weight_loader(param, up, "w3", e)
                else:
                    self.weight_loader(param, loaded[e], shard_id, e)
            return
        local = self.expert_shard.slot_of(expert_id)
        if local is None:
            return  # held by another expert-parallel rank
        target = param.data[local]
        if target.dim() == 0:  # one scalar per expert (per-tensor scales)
            target.copy_(loaded.reshape(()))
            return
        if param is self.w2_bias and shard_id == "w2":  # [H]: whole on every rank
            check_shape(target, loaded, f"{self.prefix} (expert {expert_id}, down bias)")
            target.copy_(loaded)
            return
        if shard_id in ("w1", "w3"):
            rows = target.shape[0] // 2
            if self.moe_tp_size > 1:
                loaded = loaded.narrow(0, self.moe_tp_rank * rows, rows)
            target = target.narrow(0, 0 if shard_id == "w1" else rows, rows)
        elif shard_id == "w2":
            if self.moe_tp_size > 1 and target.dim() > 1:
                cols = target.shape[1]
                loaded = loaded.narrow(1, self.moe_tp_rank * cols, cols)
        else:
            raise ModelLoadError(f"{self.prefix}: unknown expert shard {shard_id!r}")
        check_shape(target, loaded, f"{self.prefix} (expert {expert_id}, {shard_id})")
        target.copy_(loaded)

    # ------------------------------------------------------------------ compute
    def local_expert_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's local slots; -1 for pairs another rank computes."""
        return self.expert_shard.local_ids(topk_ids)

    def _record_counts(self, topk_ids: torch.Tensor) -> None:
        try:
            ctx = get_forward_context()
        except RuntimeError:  # called outside the runner (unit tests): nothing to record
            return
        ids = topk_ids.reshape(-1)
        ids = ids if ids.dtype == torch.long else ids.long()
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=ids.device)
        counts.index_add_(0, ids, pair_weights(ctx, topk_ids.shape, ids.device))
        previous = ctx.expert_counts.get(self.prefix)
        ctx.expert_counts[self.prefix] = counts if previous is None else previous + counts

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                correction_bias: torch.Tensor | None = None) -> torch.Tensor:
        topk_weights, topk_ids = self.routing.select(router_logits, correction_bias)
        self._record_counts(topk_ids)
        out = self.quant_method.apply(self, hidden, topk_weights, self.local_expert_ids(topk_ids))
        if self.reduce_results and self.tp_size > 1:
            out = tensor_parallel_all_reduce(out)
        return out

    def extra_repr(self) -> str:
        r = self.routing
        return (f"experts={self.num_experts}, top_k={r.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size_per_partition}x{self.moe_tp_size}, "
                f"holds={self.expert_shard.describe()}, scoring={r.scoring}, "
                f"groups={r.num_groups}/{r.topk_groups}")
