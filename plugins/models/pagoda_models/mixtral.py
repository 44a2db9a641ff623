"""Mixtral (8x7B, 8x22B): Llama attention (optionally with Mistral's sliding window) and sparse
MoE MLPs in every layer.

``block_sparse_moe``: router ``gate`` [E, H] -> softmax over the ``num_local_experts`` in
float32, the ``num_experts_per_tok`` largest, renormalised to sum to 1 -> the experts
(``w1`` gate, ``w3`` up, ``w2`` down, SiLU) through the core ``FusedMoE`` layer. Checkpoints
name experts ``...block_sparse_moe.experts.{e}.w1.weight``; transformers 5's in-memory
``mlp.experts.gate_up_proj`` / ``down_proj`` stacks are read too.
"""

from __future__ import annotations

import torch
from pagoda.distributed import get_tp_size, tensor_parallel_all_reduce
from pagoda.layers import FusedMoE, ReplicatedLinear, RMSNorm, Routing, expert_params_mapping
from pagoda.loader.weights import LLAMA_STACKED, load_by_name
from torch import nn

from pagoda_models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        hidden = config.hidden_size
        self.tp_size = get_tp_size()
        routing = Routing(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok, scoring="softmax",
                          renormalize=True)
        self.gate = ReplicatedLinear(hidden, config.num_local_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(routing, hidden, config.intermediate_size, config.hidden_act, reduce_results=False,
                                quant_config=quant_config, prefix=f"{prefix}.experts")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        return tensor_parallel_all_reduce(out) if self.tp_size > 1 else out


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with the sparse MoE block as its MLP."""

    def __init__(self, config, layer_idx: int, quant_config, prefix: str, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool):
        nn.Module.__init__(self)
        self.self_attn = LlamaAttention(config, layer_idx, quant_config, f"{prefix}.self_attn", qkv_bias, o_bias,
                                        qk_norm)
        self.block_sparse_moe = MixtralSparseMoeBlock(config, quant_config, f"{prefix}.block_sparse_moe")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def mlp(self) -> nn.Module:  # LlamaDecoderLayer.forward calls self.mlp
        return self.block_sparse_moe


def _rename(name: str) -> str:
    """transformers 5's in-memory names (``mlp.gate``, ``mlp.experts.*``) -> the checkpoint's."""
    return name.replace(".mlp.", ".block_sparse_moe.")


class MixtralForCausalLM(LlamaForCausalLM):
    FEATURES = ("softmax top-k routing renormalised over the chosen experts, SiLU experts (w1/w3/w2) via "
                "fused_moe with per-expert load counts, sliding window when the config sets one")
    TESTED = ("prompt logits (fp32) and 32+ greedy tokens with chunked prefill, preemption and prefix caching; "
              "sliding window on/off, top-2 and top-3 of 8 experts; expert counts vs the HF router's choices "
              "(plugins/models/tests/test_models_mixtral_gpt_oss.py)")
    decoder_layer = MixtralDecoderLayer

    def load_weights(self, weights) -> set[str]:
        tied = getattr(self.config, "tie_word_embeddings", False)

        def skip(name: str) -> bool:
            return "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")

        return load_by_name(self, weights, LLAMA_STACKED, skip=skip, rename=_rename,
                            experts=expert_params_mapping(self.config.num_local_experts, "w1", "w3", "w2"))
