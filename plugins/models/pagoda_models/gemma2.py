"""Gemma 2: Llama's projections with four (1 + w) RMSNorms per layer, sliding-window and global
layers alternating, tanh soft-capping of attention scores and final logits.

Per layer (``layer_types``, by default sliding on even layers):

    h = h + post_attention_norm(attn(input_norm(h)))
    h = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))

Every norm is ``x_normalised * (1 + w)`` in float32, rounded once (``RMSNorm(offset=1.0)``).
Attention scale ``query_pre_attn_scalar ** -0.5``; scores soft-capped as ``c * tanh(s / c)``
with ``c = attn_logit_softcapping``; sliding layers see the last ``sliding_window`` positions.
Embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model dtype; the logits are
soft-capped by ``final_logit_softcapping``. The MLP is gated GELU (tanh), ``hidden_activation``.
Gemma 3 (``gemma3.py``) adds per-head q/k norms and a rope per layer type.
"""

from __future__ import annotations

import torch
from pagoda.errors import ModelLoadError
from pagoda.layers import (
    Attention,
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

from pagoda_models.llama import LlamaMLP, head_dim_of, sliding_window_of

GEMMA_NORM_OFFSET = 1.0  # Gemma's RMSNorm multiplies by (1 + weight)


def gemma_rope_parameters(config, layer_idx: int) -> dict:
    """The rope of one layer: Gemma 3 keeps one set per layer type (``rope_parameters =
    {"sliding_attention": {...}, "full_attention": {...}}``); Gemma 2 one for all layers."""
    params = getattr(config, "rope_parameters", None)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(params, dict) and layer_types and layer_types[layer_idx] in params:
        own = dict(params[layer_types[layer_idx]] or {})
        own.setdefault("rope_type", own.get("type", "default"))
        return own
    return rope_parameters_of(config)


def hidden_activation_of(config) -> str:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")


class Gemma2Attention(nn.Module):
    def __init__(self, config, layer_idx: int, quant_config, prefix: str, qk_norm: bool = False):
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = hd = head_dim_of(config)
        total_heads = config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or total_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, hd, total_heads, total_kv, bias=bias, quant_config=quant_config,
                                          prefix=f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(total_heads * hd, hidden, bias=bias, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(hd, hd, config.max_position_embeddings, gemma_rope_parameters(config, layer_idx),
                                   is_neox_style=True)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps, offset=GEMMA_NORM_OFFSET) if qk_norm else None
        self.k_norm = RMSNorm(hd, config.rms_norm_eps, offset=GEMMA_NORM_OFFSET) if qk_norm else None
        self.attn = Attention(self.num_heads, hd, config.query_pre_attn_scalar ** -0.5, self.num_kv_heads,
                              sliding_window=sliding_window_of(config, layer_idx),
                              logits_soft_cap=getattr(config, "attn_logit_softcapping", None) or None,
                              prefix=f"{prefix}.attn")
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:  # per head, before rotary (Gemma 3)
            t = q.shape[0]
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, -1)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Gemma2DecoderLayer(nn.Module):
    qk_norm = False

    def __init__(self, config, layer_idx: int, quant_config, prefix: str):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma2Attention(config, layer_idx, quant_config, f"{prefix}.self_attn", self.qk_norm)
        self.mlp = LlamaMLP(hidden, config.intermediate_size, hidden_activation_of(config), False, quant_config,
                            f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(hidden, eps, offset=GEMMA_NORM_OFFSET)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=GEMMA_NORM_OFFSET)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=GEMMA_NORM_OFFSET)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset=GEMMA_NORM_OFFSET)

    def forward(self, positions, hidden, residual):
        """(hidden, residual) -> (this layer's MLP output, the residual stream before it): the
        next norm adds them, as HF's ``residual + post_norm(...)`` does."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2Model(nn.Module):
    def __init__(self, config, quant_config, prefix: str, layer_cls=Gemma2DecoderLayer):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        # sqrt(hidden) rounded to the model dtype, as transformers multiplies (bf16: 55.4256 -> 55.5)
        self.register_buffer("normalizer", torch.tensor(config.hidden_size ** 0.5), persistent=False)
        self.layers = nn.ModuleList(layer_cls(config, i, quant_config, f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=GEMMA_NORM_OFFSET)

    def forward(self, input_ids, positions):
        hidden = self.embed_tokens(input_ids)
        hidden, residual = hidden * self.normalizer.to(hidden.dtype), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (computed in float32), or the logits unchanged."""
    if not cap:
        return logits
    return (torch.tanh(logits.float() / cap) * cap).to(logits.dtype)


class Gemma2ForCausalLM(nn.Module):
    FEATURES = ("sliding-window and global layers alternating (layer_types; window layers keep only their window's "
                "KV blocks), attention and final logit soft-capping, query_pre_attn_scalar, pre/post attention and "
                "feed-forward (1 + w) RMSNorms, "
                "sqrt(hidden)-scaled embeddings, gated GELU-tanh MLP, tied embeddings")
    TESTED = ("prompt logits (fp32) and 32+ greedy tokens with chunked prefill, preemption and prefix caching; "
              "prompts longer than the window; soft-caps on/off (plugins/models/tests/test_models_gemma.py); "
              "Triton path under the interpreter (plugins/cuda/tests/test_model_triton.py)")
    decoder_layer = Gemma2DecoderLayer

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ModelLoadError("config use_bidirectional_attention=true (an embedding model) is not supported: "
                                 "pagoda runs causal language models")
        self.config = config
        self.model = Gemma2Model(config, quant_config, "model", self.decoder_layer)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.tie_to(self.model.embed_tokens)
        self.final_soft_cap = getattr(config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head.compute_logits(hidden), self.final_soft_cap)

    def load_weights(self, weights) -> set[str]:
        tied = getattr(self.config, "tie_word_embeddings", True)

        def skip(name: str) -> bool:
            return "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")

        return load_by_name(self, weights, LLAMA_STACKED, skip=skip)
