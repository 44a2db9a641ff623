"""DeepSeek-V3 (and R1): Multi-head Latent Attention and sigmoid-routed experts.

Attention (``DeepseekV3Attention``), per token, N heads, P = qk_nope_head_dim, R =
qk_rope_head_dim, V = v_head_dim, L = kv_lora_rank:

    q = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x) without q_lora_rank)  -> [N, P + R]
    [c, k_pe] = kv_a_proj_with_mqa(x);  c = kv_a_layernorm(c)                    -> [L], [R]
    rotary on q's last R dims and on k_pe (interleaved pairs when rope_interleave)

and the core ``MLAAttention`` layer stores only (c, k_pe) in the KV cache — L + R values per
token and layer — and attends with kv_b_proj's up-projections (absorbed into the query for
decodes). Softmax scale: (P + R)^-0.5, times mscale(factor, mscale_all_dim)^2 when the rope
is scaled (YaRN). The two LoRA norms use eps 1e-6 as transformers does.

MLP: the first ``first_k_dense_replace`` layers are dense; the others are MoE blocks: the
router ``gate`` [E, H] and ``e_score_correction_bias`` are kept and computed in float32;
routing is sigmoid grouped top-k (``n_group``, ``topk_group``, ``num_experts_per_tok``,
``norm_topk_prob``, ``routed_scaling_factor``) through the core ``Routing``; routed experts
run through ``FusedMoE`` and ``n_shared_experts`` shared experts are added.

The multi-token-prediction layers that real checkpoints carry
(``model.layers.{num_hidden_layers}...``) are skipped on load; speculative decoding method "mtp"
loads them as their own model (``pagoda_models.deepseek_mtp``).
"""

from __future__ import annotations

import math
import re

import torch
from pagoda.distributed import get_tp_size, tensor_parallel_all_reduce
from pagoda.errors import ModelLoadError
from pagoda.layers import (
    ColumnParallelLinear,
    FusedMoE,
    MLAAttention,
    ReplicatedLinear,
    RMSNorm,
    Routing,
    RowParallelLinear,
    expert_params_mapping,
    get_rope,
    rope_parameters_of,
)
from pagoda.loader.weights import load_by_name
from torch import nn

from pagoda_models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

LORA_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps
MLP_STACKED = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


def mla_softmax_scale(config, rope_parameters: dict) -> float:
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    if rope_parameters.get("rope_type", "default") != "default":
        mscale_all_dim = rope_parameters.get("mscale_all_dim") or 0
        factor = rope_parameters.get("factor") or 1.0
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


class DeepseekV3Attention(nn.Module):
    def __init__(self, config, layer_idx: int, quant_config, prefix: str):
        super().__init__()
        hidden = config.hidden_size
        tp = get_tp_size()
        total_heads = config.num_attention_heads
        if total_heads % tp:
            raise ModelLoadError(f"config num_attention_heads={total_heads} is not divisible by "
                                 f"tensor_parallel_size={tp}")
        self.num_heads = total_heads // tp
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        bias = bool(getattr(config, "attention_bias", False))
        qk_head = self.nope + self.rope
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias, quant_config=quant_config,
                                             prefix=f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * qk_head, bias=False,
                                                 quant_config=quant_config, prefix=f"{prefix}.q_b_proj")
        else:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * qk_head, bias=False, quant_config=quant_config,
                                               prefix=f"{prefix}.q_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope, bias=bias,
                                                   quant_config=quant_config, prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, total_heads * (self.nope + self.v_head_dim),
                                              bias=False, quant_config=quant_config, prefix=f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(total_heads * self.v_head_dim, hidden, bias=bias, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        params = rope_parameters_of(config)
        self.rotary_emb = get_rope(self.rope, self.rope, config.max_position_embeddings, params,
                                   is_neox_style=not getattr(config, "rope_interleave", True))
        self.mla_attn = MLAAttention(self.num_heads, self.nope, self.rope, self.v_head_dim, self.kv_lora_rank,
                                     mla_softmax_scale(config, params), self.kv_b_proj, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q = q.view(t, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope], dim=-1)
        kv_c_normed = self.kv_a_layernorm(kv_c.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(t, -1), k_pe.contiguous())
        out = self.mla_attn(q_nope, q_pe.view(t, self.num_heads, self.rope), kv_c_normed, k_pe)
        return self.o_proj(out)


class DeepseekV3MoE(nn.Module):
    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        hidden = config.hidden_size
        self.tp_size = get_tp_size()
        num_experts = config.n_routed_experts
        routing = Routing(num_experts=num_experts, top_k=config.num_experts_per_tok, scoring="sigmoid",
                          renormalize=bool(config.norm_topk_prob), num_groups=getattr(config, "n_group", None) or 1,
                          topk_groups=getattr(config, "topk_group", None) or 1,
                          scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0))
        # the router stays in float32 whatever the model dtype (and is never quantized)
        self.gate = ReplicatedLinear(hidden, num_experts, bias=False, prefix=f"{prefix}.gate",
                                     params_dtype=torch.float32)
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                         requires_grad=False)
        self.experts = FusedMoE(routing, hidden, config.moe_intermediate_size, config.hidden_act,
                                reduce_results=False, quant_config=quant_config, prefix=f"{prefix}.experts")
        shared = (getattr(config, "n_shared_experts", 0) or 0) * config.moe_intermediate_size
        self.shared_experts = None
        if shared:
            self.shared_experts = LlamaMLP(hidden, shared, config.hidden_act, False, quant_config,
                                           f"{prefix}.shared_experts", reduce_results=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden.float()), self.gate.e_score_correction_bias)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return tensor_parallel_all_reduce(out) if self.tp_size > 1 else out


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block (same forward) with MLA attention and a dense or MoE MLP."""

    def __init__(self, config, layer_idx: int, quant_config, prefix: str, **_llama_attention_flags):
        nn.Module.__init__(self)
        self.self_attn = DeepseekV3Attention(config, layer_idx, quant_config, f"{prefix}.self_attn")
        if layer_idx >= (getattr(config, "first_k_dense_replace", 0) or 0) and config.n_routed_experts:
            self.mlp = DeepseekV3MoE(config, quant_config, f"{prefix}.mlp")
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, False,
                                quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    FEATURES = ("MLA with/without q_lora_rank, latent KV cache (kv_lora_rank + qk_rope_head_dim per token), "
                "absorbed decode; YaRN with mscale, rope_interleave; sigmoid grouped top-k with "
                "e_score_correction_bias, routed_scaling_factor, float32 router; shared experts; "
                "first_k_dense_replace; MTP layers skipped on load (speculative method mtp loads them: "
                "DeepSeekMTPModel)")
    TESTED = ("prompt logits (fp32) and 32+ greedy tokens with chunked prefill and preemption; q_lora on/off, "
              "n_group > 1 with a correction bias, YaRN with mscale, interleaved and plain rope, MTP tensors in "
              "the checkpoint; cache bytes per token; expert counts vs the HF router's choices "
              "(plugins/models/tests/test_models_deepseek.py)")
    decoder_layer = DeepseekV3DecoderLayer
    mtp_architecture = "DeepSeekMTPModel"  # what speculative method mtp loads from the skipped MTP layers

    def load_weights(self, weights) -> set[str]:
        tied = getattr(self.config, "tie_word_embeddings", False)
        num_layers = self.config.num_hidden_layers

        def skip(name: str) -> bool:
            match = _LAYER_INDEX.match(name)
            if match and int(match.group(1)) >= num_layers:
                return True  # multi-token-prediction layer(s)
            return "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")

        return load_by_name(self, weights, MLP_STACKED, skip=skip,
                            experts=expert_params_mapping(self.config.n_routed_experts))

