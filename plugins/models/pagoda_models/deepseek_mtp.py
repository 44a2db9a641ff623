"""DeepSeek-V3's multi-token-prediction layer (``model.layers.{num_hidden_layers}.*`` of a checkpoint), as
the drafter of speculative decoding method "mtp" (docs/speculative.md), in vLLM's form.

At position p it reads the next token x_{p+1} and the target's hidden state h_p (the target model's
output, after its final norm) and predicts x_{p+2}:

    x = eh_proj([enorm(embed(x_{p+1})), hnorm(h_p)])        [2H] -> [H]
    x = decoder_layer(x)  (MLA attention with its own KV cache, an MoE or dense MLP; plus the residual)
    logits = shared_head.head(shared_head.norm(x))

Drafting k > 1 tokens chains the layer on its own output hidden state. ``previous_hidden`` [T, H] is
set by the proposer before each forward (one row per input token). A checkpoint whose MTP layer lacks
its own ``embed_tokens`` or ``shared_head.head`` uses the main model's embedding and LM head.
"""

from __future__ import annotations

import re

import torch
from pagoda.layers import ParallelLMHead, ReplicatedLinear, RMSNorm, VocabParallelEmbedding, expert_params_mapping
from pagoda.loader.weights import load_by_name
from torch import nn

from pagoda_models.deepseek_v3 import MLP_STACKED, DeepseekV3DecoderLayer


class SharedHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="shared_head.head")


class DeepSeekMTPModel(nn.Module):
    FEATURES = ("DeepSeek-V3's multi-token-prediction layer, loaded from model.layers.{num_hidden_layers}.* as the "
                "drafter of speculative decoding method mtp (docs/speculative.md), not a model of its own")
    TESTED = "greedy outputs with mtp speculation equal plain decoding (tests/test_speculative_mtp.py)"
    supports_graphs = False  # previous_hidden is set from outside each forward

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.layer_index = config.num_hidden_layers
        hidden = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, prefix="embed_tokens")
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, bias=False, quant_config=quant_config, prefix="eh_proj")
        self.block = DeepseekV3DecoderLayer(config, self.layer_index, quant_config, "block")
        self.shared_head = SharedHead(config)
        self.previous_hidden: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embeds = self.enorm(self.embed_tokens(input_ids))
        previous = self.hnorm(self.previous_hidden.to(embeds.dtype))
        x = self.eh_proj(torch.cat([embeds, previous], dim=-1))
        x, residual = self.block(positions, x, None)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head.compute_logits(self.shared_head.norm(hidden))

    def load_weights(self, weights) -> set[str]:
        own = re.compile(rf"^model\.layers\.{self.layer_index}\.")
        mine = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
        found: set[str] = set()
        fallback: dict[str, torch.Tensor] = {}
        tied = getattr(self.config, "tie_word_embeddings", False)

        def chosen():
            for name, tensor in weights:
                if own.match(name):
                    rest = own.sub("", name)
                    found.add(rest)
                    yield (rest if rest.startswith(mine) else f"block.{rest}"), tensor
                elif name == "model.embed_tokens.weight":
                    fallback["embed_tokens.weight"] = tensor
                    if tied:
                        fallback["shared_head.head.weight"] = tensor
                elif name == "lm_head.weight":
                    fallback["shared_head.head.weight"] = tensor
            for name, tensor in fallback.items():  # the main model's, where the MTP layer has none
                if name not in found:
                    yield name, tensor

        def skip(name: str) -> bool:
            return "rotary_emb.inv_freq" in name

        loaded = load_by_name(self, chosen(), MLP_STACKED, skip=skip,
                              experts=expert_params_mapping(self.config.n_routed_experts))
        if not found:
            from pagoda.errors import ModelLoadError

            raise ModelLoadError(f"the checkpoint has no multi-token-prediction layer (model.layers."
                                 f"{self.layer_index}.*): speculative method mtp needs one")
        return loaded
