"""Method "eagle3": an EAGLE-3 head drafts from the target's auxiliary hidden states.

The head (pagoda-models' ``LlamaForCausalLMEagle3``, from ``speculative_config.model``) runs in its own
ModelRunner with its own paged KV cache (its one attention layer), exactly as the MTP layer does
(``pagoda.speculative.mtp``, whose shadow sequences and chaining this reuses): after each target step
it runs over the positions the target computed and kept, position p reading the token x_{p+1} and the
target's auxiliary hidden states at p; its last row drafts the token after the sequence's last one, and
k > 1 drafts chain the head on its own output hidden state (with its KV cache, nothing recomputed).

The target records the residual stream entering three of its layers (``LlamaModel.
aux_hidden_state_layers``, opt-in): the head config's ``eagle_config.eagle_aux_hidden_state_layer_ids``,
else layers 2, L // 2 and L - 3 of an L-layer target, as vLLM picks them.
"""

from __future__ import annotations

import logging

import torch

from pagoda.errors import ConfigError
from pagoda.speculative.config import SpeculativeConfig
from pagoda.speculative.draft_model import DRAFT_SEED_OFFSET
from pagoda.speculative.mtp import MTPProposer

logger = logging.getLogger("pagoda")
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def aux_layer_ids(head_config, num_layers: int) -> tuple[int, ...]:
    """The target layers whose input hidden states the head fuses (vLLM's default: 2, L // 2, L - 3)."""
    eagle = getattr(head_config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    ids = tuple(ids) if ids else (2, num_layers // 2, num_layers - 3)
    if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in ids):
        raise ConfigError(f"speculative_config.model: eagle3 needs three target layers in 0..{num_layers - 1}, got "
                          f"{list(ids)} (set eagle_config.eagle_aux_hidden_state_layer_ids in the head's config.json)")
    return ids


class Eagle3Proposer(MTPProposer):
    def __init__(self, engine, spec: SpeculativeConfig):  # (MTPProposer's loading is not used)
        from pagoda.engine.model_runner import ModelRunner
        from pagoda.loader.model_loader import load_config
        from pagoda.loader.source import resolve_source

        config, runner = engine.config, engine.runner
        try:
            source = resolve_source(spec.model, spec.revision, config.download_dir)
            hf_config = load_config(source)
        except ConfigError as exc:
            raise ConfigError(f"speculative_config.model {spec.model!r}: {exc}") from None
        arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
        if arch not in ARCHITECTURES:
            raise ConfigError(f"speculative_config.model {spec.model!r}: method 'eagle3' needs an EAGLE-3 head "
                              f"(config.json architectures {list(ARCHITECTURES[:1])}), not {arch}")
        hf_config.architectures = [ARCHITECTURES[0]]
        # heads are often trained with a short max_position_embeddings: their rope covers the target's length
        longest = getattr(hf_config, "max_position_embeddings", None) or 0
        hf_config.max_position_embeddings = max(longest, engine.max_model_len)
        if hf_config.vocab_size != engine.hf_config.vocab_size:
            raise ConfigError(f"speculative_config.model {spec.model!r}: its vocab_size {hf_config.vocab_size} "
                              f"differs from the target's {engine.hf_config.vocab_size}")
        target = getattr(runner.model, "model", None)
        if not getattr(runner.model, "supports_eagle3", False) or not hasattr(target, "aux_hidden_state_layers"):
            raise ConfigError(f"speculative_config: method 'eagle3' needs a target that exposes its layers' hidden "
                              f"states (the Llama family); {type(runner.model).__name__} does not")
        self.layer_ids = aux_layer_ids(hf_config, engine.hf_config.num_hidden_layers)
        target.aux_hidden_state_layers = self.layer_ids
        self.target = target
        head_config = config.model_copy(update=dict(
            model=spec.model, revision=spec.revision, quantization=spec.quantization, speculative_config=None,
            tensor_parallel_size=1, enforce_eager=True, model_impl="pagoda", expert_placement=None,
            enable_expert_parallel=False))
        self.k = spec.num_speculative_tokens
        self.max_num_seqs, self.max_model_len = config.max_num_seqs, engine.max_model_len
        self.runner = ModelRunner(head_config, source, hf_config, engine.platform, runner.dtype_name, runner.device)
        head = self.runner.model
        if head.embedding_from_target:  # a head without embed_tokens uses the target's
            shared = target.embed_tokens.weight
            if shared.shape != head.embed_tokens.weight.shape:
                raise ConfigError(f"speculative_config.model {spec.model!r}: the head has no embed_tokens and the "
                                  f"target's embedding {tuple(shared.shape)} does not fit its hidden_size")
            head.embed_tokens.weight = shared
        self.block_manager = None
        self.shadows = {}  # seq_id -> (seq, shadow, preemptions)
        self.pending = {}  # seq_id -> (its length then, drafts, q rows)
        self.generator = torch.Generator(device=runner.device).manual_seed(config.seed + DRAFT_SEED_OFFSET)
        self._generators = {}
        logger.info("speculative decoding: EAGLE-3 head %s (target layers %s) loaded in %.1f s", source.name,
                    list(self.layer_ids), self.runner.load_seconds)

    def after_step(self, vout, hidden: torch.Tensor, qsl: list[int], engine, may_speculate) -> None:
        """As the MTP layer, on the target's auxiliary hidden states [T, 3H] instead of its output."""
        recorded = self.target.aux_hidden_states
        fused = torch.cat([recorded[i] for i in self.layer_ids], dim=-1)
        recorded.clear()
        super().after_step(vout, fused, qsl, engine, may_speculate)
