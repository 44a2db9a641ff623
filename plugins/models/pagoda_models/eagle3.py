"""An EAGLE-3 head (``LlamaForCausalLMEagle3`` checkpoints), the drafter of speculative decoding method
"eagle3" (docs/speculative.md), in the form vLLM and SGLang load it.

At position p it reads the next token x_{p+1} and g_p, the target's auxiliary hidden states at p (the
residual stream entering three of its layers, concatenated: [T, 3 * target_hidden]), and predicts
x_{p+2}:

    h = fc(g_p)                                                      [3H] -> [H]
    x = attention(concat(input_layernorm(embed(x_{p+1})), hidden_norm(h)))     qkv_proj: [2H] -> q, k, v
    x, r = post_attention_layernorm(x, h);  out = mlp(x) + r         (one decoder layer, its own KV cache)
    logits = lm_head(norm(out))          over the draft vocabulary; draft id i is target id i + d2t[i]

Drafting k > 1 tokens chains the head on its own ``out`` (width H: no ``fc``). ``previous_hidden``
[T, 3H or H] is set by the proposer before each forward. Checkpoint names: ``fc.*``, ``midlayer.*``
(or ``layers.0.*``), ``norm.*``, ``lm_head.*``, ``d2t``, ``t2d`` (unused), ``embed_tokens.*`` (when
absent the proposer shares the target's embedding); a leading ``model.`` is ignored.
"""

from __future__ import annotations

import torch
from pagoda.layers import ParallelLMHead, QKVParallelLinear, ReplicatedLinear, RMSNorm, VocabParallelEmbedding
from pagoda.loader.weights import LLAMA_STACKED, load_by_name
from torch import nn

from pagoda_models.llama import LlamaAttention, LlamaMLP, head_dim_of


class Eagle3DecoderLayer(nn.Module):
    """The head's one layer: attention over [embedding, hidden] (width 2H), then a Llama MLP."""

    def __init__(self, config, quant_config, prefix: str = "midlayer"):
        super().__init__()
        hidden = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = LlamaAttention(config, 0, quant_config, f"{prefix}.self_attn", bias, False, False)
        heads = config.num_attention_heads
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * hidden, head_dim_of(config), heads, getattr(config, "num_key_value_heads", None) or heads, bias=bias,
            quant_config=quant_config, prefix=f"{prefix}.self_attn.qkv_proj")
        self.mlp = LlamaMLP(hidden, config.intermediate_size, config.hidden_act, getattr(config, "mlp_bias", False),
                            quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, positions, embeds, hidden):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = self.self_attn(positions, torch.cat([self.input_layernorm(embeds), normed], dim=-1))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) + residual


class LlamaForCausalLMEagle3(nn.Module):
    FEATURES = ("an EAGLE-3 head (fc over three target layers' hidden states, one decoder layer over "
                "[embedding, hidden], a draft vocabulary mapped by d2t), the drafter of speculative decoding "
                "method eagle3 (docs/speculative.md), not a model of its own")
    TESTED = "greedy outputs with eagle3 speculation equal plain decoding (tests/test_speculative_eagle3.py)"
    supports_graphs = False  # previous_hidden is set from outside each forward

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        target_hidden = getattr(config, "target_hidden_size", None) or hidden
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, prefix="embed_tokens")
        self.fc = ReplicatedLinear(3 * target_hidden, hidden, bias=False, quant_config=quant_config, prefix="fc")
        self.midlayer = Eagle3DecoderLayer(config, quant_config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden, prefix="lm_head")
        # draft id i is target id i + d2t[i] (identity when the vocabularies are the same)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long), persistent=False)
        self.scatter = self.draft_vocab_size != config.vocab_size  # (set again when d2t is loaded)
        self.previous_hidden: torch.Tensor | None = None
        self.embedding_from_target = False  # set by load_weights: the proposer shares the target's embedding

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        hidden = self.previous_hidden.to(embeds.dtype)
        if hidden.shape[-1] != embeds.shape[-1]:  # the target's auxiliary hidden states: fuse them
            hidden = self.fc(hidden)
        return self.midlayer(positions, embeds, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [T, target vocab]: the draft vocabulary's, scattered to their target ids, -inf elsewhere."""
        draft = self.lm_head.compute_logits(self.norm(hidden))[:, :self.draft_vocab_size]
        if not self.scatter:
            return draft
        full = draft.new_full((draft.shape[0], self.config.vocab_size), float("-inf"))
        ids = torch.arange(self.draft_vocab_size, device=draft.device) + self.d2t
        return full.index_copy_(1, ids, draft)

    def load_weights(self, weights) -> set[str]:
        def named():
            for name, tensor in weights:
                name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
                if name == "d2t":
                    if tensor.shape != self.d2t.shape:
                        from pagoda.errors import ModelLoadError

                        raise ModelLoadError(f"eagle3 head: d2t has shape {tuple(tensor.shape)}, config.json's "
                                             f"draft_vocab_size is {self.draft_vocab_size}")
                    self.d2t.copy_(tensor.to(torch.long))
                    self.scatter = self.scatter or bool(tensor.any())
                elif name != "t2d":
                    yield name, tensor

        loaded = load_by_name(self, named(), LLAMA_STACKED, skip=lambda name: "rotary_emb.inv_freq" in name)
        if "embed_tokens.weight" not in loaded:
            self.embedding_from_target = True
            loaded.add("embed_tokens.weight")
        return loaded
