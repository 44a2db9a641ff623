"""DeepSeek-V3.2 (-Exp): DeepSeek-V3 with DeepSeek Sparse Attention.

Every attention layer has a lightning indexer next to MLA (``DeepseekV32Indexer``):

    index_q = wq_b(q_resid)                 [T, Hi, Di]   q_resid = q_a_layernorm(q_a_proj(x))
    index_k = LayerNorm(wk(x))              [T, Di]       (eps 1e-6, with a bias)
    rotary on the first R = qk_rope_head_dim dims of both, rotating halves (MLA's own rotary
    rotates interleaved pairs)
    weights = weights_proj(x) * Hi^-0.5 * Di^-0.5   [T, Hi] float32 (the projection kept in float32)

and the core's ``SparseMLAAttention`` keeps ``index_k`` next to MLA's latent in the cache, scores
``sum_h weights[h] * relu(index_q[h] . index_k)`` over each query's visible tokens, keeps the
``index_topk`` best and runs MLA over them only (``pagoda.layers.sparse_mla``). The rest is
DeepSeek-V3 (``deepseek_v3.py``): q_lora_rank always, MoE per ``mlp_layer_types``.

transformers computes the indexer in bf16/fp32 (no Hadamard rotation, no fp8 index cache),
which is what pagoda does too: the same selection, the reference for the tests.
"""

from __future__ import annotations

import torch
from pagoda.errors import ModelLoadError
from pagoda.layers import ReplicatedLinear, RMSNorm, SparseMLAAttention, get_rope, rope_parameters_of
from torch import nn

from pagoda_models.deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3DecoderLayer,
    DeepseekV3ForCausalLM,
    DeepseekV3MoE,
    mla_softmax_scale,
)
from pagoda_models.llama import LlamaMLP

INDEX_NORM_EPS = 1e-6


class DeepseekV32Indexer(nn.Module):
    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        rope = config.qk_rope_head_dim
        if self.head_dim < rope:
            raise ModelLoadError(f"config index_head_dim={self.head_dim} is smaller than qk_rope_head_dim={rope}")
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False,
                                     quant_config=quant_config, prefix=f"{prefix}.wq_b")
        self.wk = ReplicatedLinear(config.hidden_size, self.head_dim, bias=False, quant_config=quant_config,
                                   prefix=f"{prefix}.wk")
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEX_NORM_EPS)
        self.weights_proj = ReplicatedLinear(config.hidden_size, self.n_heads, bias=False,
                                             prefix=f"{prefix}.weights_proj", params_dtype=torch.float32)
        self.rotary_emb = get_rope(self.head_dim, rope, config.max_position_embeddings, rope_parameters_of(config),
                                   is_neox_style=True)
        self.weight_scale = self.n_heads ** -0.5 * self.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, q_resid: torch.Tensor):
        """-> (index_q [T, Hi, Di], index_k [T, Di], weights [T, Hi] float32)."""
        t = hidden.shape[0]
        q = self.wq_b(q_resid)
        k = self.k_norm(self.wk(hidden))
        q, k = self.rotary_emb(positions, q, k)
        weights = self.weights_proj(hidden.float()) * self.weight_scale
        return q.view(t, self.n_heads, self.head_dim), k, weights


class DeepseekV32Attention(DeepseekV3Attention):
    """DeepSeek-V3's MLA (interleaved rotary) over the indexer's top-k tokens."""

    def __init__(self, config, layer_idx: int, quant_config, prefix: str):
        if not getattr(config, "q_lora_rank", None):
            raise ModelLoadError("DeepSeek-V3.2 needs config q_lora_rank: the indexer reads the query's low-rank "
                                 "projection")
        super().__init__(config, layer_idx, quant_config, prefix)
        params = rope_parameters_of(config)
        self.rotary_emb = get_rope(self.rope, self.rope, config.max_position_embeddings, params, is_neox_style=False)
        self.indexer = DeepseekV32Indexer(config, quant_config, f"{prefix}.indexer")
        self.mla_attn = SparseMLAAttention(self.num_heads, self.nope, self.rope, self.v_head_dim, self.kv_lora_rank,
                                           mla_softmax_scale(config, params), self.kv_b_proj, config.index_head_dim,
                                           config.index_topk, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
        q = self.q_b_proj(q_resid).view(t, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope], dim=-1)
        kv_c_normed = self.kv_a_layernorm(kv_c.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(t, -1), k_pe.contiguous())
        index_q, index_k, index_weights = self.indexer(positions, hidden, q_resid)
        out = self.mla_attn(q_nope, q_pe.view(t, self.num_heads, self.rope), kv_c_normed, k_pe, index_q, index_k,
                            index_weights)
        return self.o_proj(out)


def is_moe_layer(config, layer_idx: int) -> bool:
    types = getattr(config, "mlp_layer_types", None)
    if types:
        return types[layer_idx] == "sparse"
    return layer_idx >= (getattr(config, "first_k_dense_replace", 0) or 0) and bool(config.n_routed_experts)


class DeepseekV32DecoderLayer(DeepseekV3DecoderLayer):
    def __init__(self, config, layer_idx: int, quant_config, prefix: str, **_llama_attention_flags):
        nn.Module.__init__(self)
        self.self_attn = DeepseekV32Attention(config, layer_idx, quant_config, f"{prefix}.self_attn")
        if is_moe_layer(config, layer_idx):
            self.mlp = DeepseekV3MoE(config, quant_config, f"{prefix}.mlp")
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, False,
                                quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    mtp_architecture = None  # (its MTP layer has an indexer: not loaded yet)
    FEATURES = ("DeepSeek-V3 plus DeepSeek Sparse Attention: a lightning indexer per layer (half-split rotary, "
                "LayerNorm key, float32 head weights) picks index_topk cached tokens per query, MLA over those only; "
                "index keys cached next to the latent (L + R + index_head_dim per token); mlp_layer_types")
    TESTED = ("prompt logits (fp32) and 32+ greedy tokens with chunked prefill, preemption and prefix caching, "
              "index_topk smaller than the prompts; cache bytes per token; the Triton sparse kernels under the "
              "interpreter against the torch reference (plugins/models/tests/test_models_deepseek_v32.py, "
              "plugins/cuda/tests/test_sparse_mla.py)")
    decoder_layer = DeepseekV32DecoderLayer
