"""IBM Granite (``GraniteForCausalLM``): a Llama-style decoder with four scalars of its own.

- the embeddings are multiplied by ``embedding_multiplier``;
- attention scores use ``attention_multiplier`` instead of 1/sqrt(head_dim);
- each block's attention and MLP outputs are multiplied by ``residual_multiplier`` before they
  join the residual stream;
- the logits are divided by ``logits_scaling``.

Everything else comes from ``pagoda.layers``: tensor-parallel linear layers, rotary embedding,
RMSNorm with the residual add fused in, the gated MLP activation and paged attention. The
model knows nothing about devices or attention metadata; the engine supplies both.
"""

from __future__ import annotations

import torch
from pagoda.layers import (
    Attention,
    GatedActivation,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope,
    rope_parameters_of,
)
from pagoda.loader.weights import LLAMA_STACKED, load_by_name
from torch import nn


class GraniteAttention(nn.Module):
    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias, quant_config=quant_config,
                                          prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size, bias=bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's share
        self.sizes = [heads * hd, kv_heads * hd, kv_heads * hd]
        self.rotary_emb = get_rope(hd, hd, config.max_position_embeddings, rope_parameters_of(config))
        self.attn = Attention(heads, hd, config.attention_multiplier, kv_heads, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.sizes, dim=-1)  # [T, heads*hd], [T, kv*hd] x2
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class GraniteMLP(nn.Module):
    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_fn = GatedActivation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GraniteDecoderLayer(nn.Module):
    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        self.self_attn = GraniteAttention(config, quant_config, f"{prefix}.self_attn")
        self.mlp = GraniteMLP(config, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions, hidden, residual):
        # ``hidden`` is the previous block's output, already scaled by residual_multiplier;
        # the fused norm adds it to the residual stream and normalises the sum
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteModel(nn.Module):
    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        self.embedding_multiplier = config.embedding_multiplier
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(GraniteDecoderLayer(config, quant_config, f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids) * self.embedding_multiplier, None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class GraniteForCausalLM(nn.Module):
    """The class pagoda builds: ``(hf_config, quant_config, prefix)`` in; ``forward``,
    ``compute_logits`` and ``load_weights`` (parameter names follow the checkpoint's)."""

    FEATURES = "Llama-style decoder with embedding, attention, residual and logits multipliers (IBM Granite)"
    TESTED = "pagoda check-model GraniteForCausalLM (tests/test_tools_plugins.py installs this example)"

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.model = GraniteModel(config, quant_config, "model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden) / self.config.logits_scaling

    def load_weights(self, weights) -> set[str]:
        """Copy the checkpoint's tensors by name (q/k/v and gate/up fused on the way); returns
        the parameter names filled, so the loader can name any left missing."""
        tied = self.config.tie_word_embeddings

        def skip(name: str) -> bool:
            return "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")

        return load_by_name(self, weights, LLAMA_STACKED, skip=skip)
