"""``TransformersForCausalLM``: a causal LM pagoda has no native class for, run through
transformers' modeling code.

The transformers model is built from the checkpoint's config with its parameters on the meta
device and ``attn_implementation="pagoda_paged"``; its linears, input embedding and LM head
are swapped for pagoda's (quantizable, tensor-parallel by ``base_model_tp_plan``) and each
attention module gets a paged ``Attention`` child. The top-level modules of the transformers
model are this module's children under the same names, so parameter names are the checkpoint's.

- ``forward(input_ids [T], positions [T])`` runs the base model on the step's flattened tokens
  as one batch row (``position_ids`` = the tokens' positions, no cache object, no mask):
  attention goes to the paged cache, everything else is transformers' code;
- ``compute_logits(hidden [N, H])`` runs transformers' own head code (LM head, then whatever the
  architecture does to logits: scaling, soft-capping) with the base model stood in for by the
  hidden states.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

from pagoda.errors import ModelLoadError
from pagoda.transformers_fallback import attention, parallel, support
from pagoda.transformers_fallback.weights import load_checkpoint

logger = logging.getLogger("pagoda")


class _BaseOutputs:
    """What a base model returns, as the head code reads it: the hidden states, None for anything else
    (router logits, caches, attentions)."""

    def __init__(self, hidden: torch.Tensor):
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> None:
        return None

    def __getitem__(self, index: int) -> torch.Tensor:
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state


class _HiddenStates(nn.Module):
    """Stands in for the base model while transformers' head code runs on given hidden states; it also
    stands in for any part the head code calls instead (OPT's head calls ``self.model.decoder``)."""

    def __init__(self, hidden: torch.Tensor, base: nn.Module):
        super().__init__()
        self.hidden = hidden
        object.__setattr__(self, "base", base)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            found = getattr(self.base, name)  # the base's settings (config, ...); its sub-modules: this stand-in
            return self if isinstance(found, nn.Module) else found

    def forward(self, *args: Any, **kwargs: Any) -> _BaseOutputs:
        return _BaseOutputs(self.hidden)


class TransformersForCausalLM(nn.Module):
    """Any other causal LM that transformers implements, through its modeling code and pagoda's paged
    attention."""

    FEATURES = ("The core's transformers fallback runs any causal LM that transformers implements through "
                "transformers' own modeling code on pagoda's paged KV cache, continuous batching and sampler: a "
                "custom attention function registered in transformers' attention interface (`pagoda_paged`) sends "
                "every attention call to pagoda's paged attention backend; the linears become pagoda's (quantization "
                "methods apply) and are split over the ranks by the model's `base_model_tp_plan`; the embedding and "
                "LM head are vocab-parallel; logits go through the architecture's own head code (logit scaling, "
                "soft-capping); checkpoints load through transformers' key conversions (e.g. per-expert tensors "
                "stacked)")
    TESTED = ("for each architecture marked in the last column, on tiny random models: prompt logits (fp32, within "
              "1e-4) and the KV cache size, 32 greedy tokens of a batch of prompts with chunked prefill and "
              "preemption, greedy tokens with prefix-cache hits, every checkpoint tensor loaded, and `pagoda "
              "check-model ARCH` (tests/test_transformers_fallback.py)")
    # what tests/test_transformers_fallback.py adds per architecture (pagoda models, docs/models.md)
    TESTED_ARCHITECTURES = {
        "Olmo2ForCausalLM": "tested: q/k RMSNorm over all heads; 2 ranks (q/k/v gathered, MLP split)",
        "GraniteForCausalLM": "tested: embedding, residual, attention and logit multipliers; 2 ranks (heads split)",
        "StableLmForCausalLM": "tested: LayerNorm, per-head q/k LayerNorm, partial rotary, parallel residual, "
                               "q/k/v bias",
        "CohereForCausalLM": "tested: logit_scale, tied embeddings, parallel attention and MLP",
        "GPTNeoXForCausalLM": "tested: fused query_key_value, parallel residual",
        "OlmoeForCausalLM": "tested: 16 experts, per-expert checkpoint tensors stacked by transformers' conversion",
        "OPTForCausalLM": "tested: learned absolute positions, LayerNorm, tied embeddings, a head that calls "
                          "model.decoder",
    }
    model_impl = "transformers"
    supports_graphs = False  # transformers' code may synchronize the host (MoE routing, dynamic rope): run eagerly

    @staticmethod
    def architectures() -> list[dict]:
        """Every architecture of the installed transformers this class runs (``pagoda models``)."""
        return support.fallback_architectures()

    @staticmethod
    def supports(architecture: str, hf_config: Any) -> str | None:
        """None when this class can run ``architecture``; otherwise why not."""
        return support.unsupported_reason(architecture, hf_config)

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        names = list(getattr(config, "architectures", None) or [])
        architecture = next((a for a in names if support.unsupported_reason(a, config) is None), None)
        if architecture is None:
            first = names[0] if names else "(no architecture)"
            raise ModelLoadError(f"{first}: the transformers fallback cannot run it: "
                                 f"{support.unsupported_reason(first, config) if names else 'config.json names none'}")
        from transformers.initialization import no_init_weights

        attention.register_attention_function()
        config = copy.deepcopy(config)  # transformers writes the dtype and attention implementation into it
        cls = support.causal_lm_class(architecture)
        with parallel.parameters_on_meta(), no_init_weights():
            hf_model = cls._from_config(config, attn_implementation=attention.IMPLEMENTATION,
                                        dtype=torch.get_default_dtype())
        hf_model.eval()
        self.config = hf_model.config
        self.base_prefix = hf_model.base_model_prefix
        base = getattr(hf_model, self.base_prefix, None)
        if not isinstance(base, nn.Module):
            raise ModelLoadError(f"{architecture}: transformers' class has no base model at {self.base_prefix!r}")
        self.tied = bool(getattr(self.config.get_text_config(), "tie_word_embeddings", False))
        plan = getattr(self.config.get_text_config(), "base_model_tp_plan", None)
        parallel.replace_linears(base, self.base_prefix, plan, quant_config)
        parallel.replace_embeddings(hf_model, self.tied)
        parallel.materialize(hf_model, torch.empty(()).device)
        self.attention_layers = self._attach_paged_attention(base, architecture)
        for name, child in hf_model.named_children():
            self.add_module(name, child)  # parameter names are the checkpoint's
        # not children: their modules are registered above
        object.__setattr__(self, "hf_model", hf_model)
        object.__setattr__(self, "base", base)
        self._verified = False

    def _attach_paged_attention(self, base: nn.Module, architecture: str) -> list:
        """A paged ``Attention`` on every attention module of ``base``: one per layer, causal, no sinks."""
        layers = []
        modules = attention.attention_modules(base)
        for name, module in modules:
            where = f"{architecture}: {self.base_prefix}.{name}"
            if getattr(module, "is_causal", True) is False:
                raise ModelLoadError(f"{where} is not causal attention; the transformers fallback runs decoders only")
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                raise ModelLoadError(f"{where} has attention sinks, which pagoda's paged attention backends do not "
                                     f"add")
            layers.append(attention.attach_paged_attention(module, self.config, f"{self.base_prefix}.{name}",
                                                           parallel.heads_split_of(module)))
        count = getattr(self.config.get_text_config(), "num_hidden_layers", None)
        if not modules or (isinstance(count, int) and len(modules) != count):
            raise ModelLoadError(f"{architecture}: the transformers fallback found {len(modules)} attention modules "
                                 f"for {count} layers; it runs models whose every layer is an attention layer")
        return layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T], positions [T] -> hidden states [T, H]."""
        out = self.base(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        if not self._verified:
            self._check_every_layer_attended()
        return hidden[0]

    def _check_every_layer_attended(self) -> None:
        """After the first forward: each paged layer was called exactly once (a layer that computed its
        attention another way would go uncached; one called twice would store its K/V twice)."""
        name = type(self.hf_model).__name__
        missed = [layer.prefix for layer in self.attention_layers if layer.calls == 0]
        if missed:
            raise ModelLoadError(f"transformers' {name} computed attention without calling the attention interface "
                                 f"in {', '.join(missed[:4])}; the transformers fallback cannot cache it")
        repeated = [layer.prefix for layer in self.attention_layers if layer.calls > 1]
        if repeated:
            raise ModelLoadError(f"transformers' {name} calls the attention of {', '.join(repeated[:4])} more than "
                                 f"once per forward; the transformers fallback caches one call per layer and step")
        self._verified = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, vocab], by transformers' head code for this architecture."""
        hf_model = self.hf_model
        hf_model._modules[self.base_prefix] = _HiddenStates(hidden[None], self.base)
        try:
            out = hf_model(inputs_embeds=hidden[None], use_cache=False)
        finally:
            hf_model._modules[self.base_prefix] = self.base
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[0]

    def load_weights(self, weights) -> set[str]:
        return load_checkpoint(self, self.hf_model, weights, self.base_prefix, self.tied)
