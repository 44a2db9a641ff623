"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Llama attention with q/k/v biases, and MLPs that
are mixtures of experts with a gated shared expert.

Sparse block (``Qwen2MoeSparseMoeBlock``): router ``gate`` [E, H] -> softmax top-k in float32
(``num_experts_per_tok``, renormalised when ``norm_topk_prob``) -> the experts through the
core ``FusedMoE`` layer; plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` when
``shared_expert_intermediate_size`` > 0. Layer ``i`` is sparse unless it is listed in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; dense layers use a plain MLP
of ``intermediate_size``. Under tensor parallelism the experts' and the shared expert's
partial sums are added, then all-reduced once.
"""

from __future__ import annotations

import torch
from pagoda.distributed import get_tp_size, tensor_parallel_all_reduce
from pagoda.layers import FusedMoE, ReplicatedLinear, RMSNorm, Routing, expert_params_mapping
from pagoda.loader.weights import LLAMA_STACKED, load_by_name
from torch import nn

from pagoda_models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


def is_sparse_layer(config, layer_idx: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and getattr(config, "num_experts", 0) > 0 and (layer_idx + 1) % step == 0)


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        hidden = config.hidden_size
        self.tp_size = get_tp_size()
        routing = Routing(num_experts=config.num_experts, top_k=config.num_experts_per_tok, scoring="softmax",
                          renormalize=bool(getattr(config, "norm_topk_prob", False)))
        self.gate = ReplicatedLinear(hidden, config.num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(routing, hidden, config.moe_intermediate_size, config.hidden_act,
                                reduce_results=False, quant_config=quant_config, prefix=f"{prefix}.experts")
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = None
        self.shared_expert_gate = None
        if shared > 0:
            self.shared_expert = LlamaMLP(hidden, shared, config.hidden_act, False, quant_config,
                                          f"{prefix}.shared_expert", reduce_results=False)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False, prefix=f"{prefix}.shared_expert_gate")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return tensor_parallel_all_reduce(out) if self.tp_size > 1 else out


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with a sparse or dense MLP (same forward)."""

    sparse_block = Qwen2MoeSparseMoeBlock

    def __init__(self, config, layer_idx: int, quant_config, prefix: str, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool):
        nn.Module.__init__(self)
        self.self_attn = LlamaAttention(config, layer_idx, quant_config, f"{prefix}.self_attn", qkv_bias, o_bias,
                                        qk_norm)
        if is_sparse_layer(config, layer_idx):
            self.mlp = self.sparse_block(config, quant_config, f"{prefix}.mlp")
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, False,
                                quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    FEATURES = ("softmax top-k routing (norm_topk_prob), sigmoid-gated shared expert, decoder_sparse_step, "
                "mlp_only_layers, q/k/v bias; experts via fused_moe with per-expert load counts")
    TESTED = ("prompt logits (fp32) and 32+ greedy tokens with chunked prefill and preemption; shared expert "
              "on/off, norm_topk_prob, dense layers (mlp_only_layers, decoder_sparse_step); expert counts vs "
              "the HF router's choices (plugins/models/tests/test_models_moe.py)")
    decoder_layer = Qwen2MoeDecoderLayer
    o_bias = False

    def attention_biases(self, config) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False

    def load_weights(self, weights) -> set[str]:
        tied = getattr(self.config, "tie_word_embeddings", False)
        shared = (getattr(self.config, "shared_expert_intermediate_size", 0) or 0) > 0

        def skip(name: str) -> bool:
            return ("rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")
                    or (not shared and ".shared_expert" in name))  # empty shared expert tensors

        return load_by_name(self, weights, LLAMA_STACKED, skip=skip,
                            experts=expert_params_mapping(getattr(self.config, "num_experts", 0)))
