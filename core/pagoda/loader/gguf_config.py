"""The model config of a GGUF file without importing transformers.

Building a transformers config class imports its model package, which cost about 70% of ``LLM()``
with the embedded default model (and 140 MB of memory). pagoda's models read a config only through
attributes, so a GGUF file's config is a plain ``ModelConfig``: the values from the metadata over the
defaults transformers' config class of the family has. ``to_hf()`` builds the transformers config
when something needs the real one (the HF baseline of ``pagoda bench``).
"""

from __future__ import annotations

from typing import Any

# The defaults of transformers' LlamaConfig / MistralConfig / Qwen2Config / Qwen3Config that pagoda's
# models read, for the keys a GGUF file does not carry.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_act="silu", attention_bias=False, mlp_bias=False, attention_dropout=0.0,
                  pretraining_tp=1, initializer_range=0.02, use_cache=True),
    "mistral": dict(hidden_act="silu", attention_dropout=0.0, initializer_range=0.02, use_cache=True,
                    sliding_window=4096),
    "qwen2": dict(hidden_act="silu", attention_dropout=0.0, initializer_range=0.02, use_cache=True,
                  use_sliding_window=False, sliding_window=None, max_window_layers=28),
    "qwen3": dict(hidden_act="silu", attention_bias=False, attention_dropout=0.0, initializer_range=0.02,
                  use_cache=True, use_sliding_window=False, sliding_window=None, max_window_layers=28),
    "phi3": dict(hidden_act="silu", attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, initializer_range=0.02,
                 use_cache=True, sliding_window=None),
    "qwen2_moe": dict(hidden_act="silu", attention_dropout=0.0, initializer_range=0.02, use_cache=True,
                      use_sliding_window=False, sliding_window=None, max_window_layers=28, decoder_sparse_step=1,
                      mlp_only_layers=[], output_router_logits=False, router_aux_loss_coef=0.001),
    "qwen3_moe": dict(hidden_act="silu", attention_bias=False, attention_dropout=0.0, initializer_range=0.02,
                      use_cache=True, use_sliding_window=False, sliding_window=None, decoder_sparse_step=1,
                      mlp_only_layers=[], output_router_logits=False, router_aux_loss_coef=0.001),
}


class ModelConfig:
    """An HF-config stand-in: ``model_type``, ``architectures`` and the family's keys as attributes."""

    def __init__(self, model_type: str, **values: Any):
        self.model_type = model_type
        self.__dict__.update(FAMILY_DEFAULTS.get(model_type, {}))
        self.__dict__.update({k: v for k, v in values.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def to_hf(self):
        """The transformers config object of the same values (imports transformers)."""
        from transformers import AutoConfig

        values = self.to_dict()
        return AutoConfig.for_model(values.pop("model_type"), **values)

    def __repr__(self) -> str:
        return f"ModelConfig({self.model_type}, {', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


def rope_parameters(theta: float, scaling: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` from GGUF's ``rope.freq_base`` and ``rope.scaling.*`` keys."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    kind = scaling.get("type")
    if kind in ("linear", "yarn") and scaling.get("factor"):
        params.update(rope_type=kind, factor=float(scaling["factor"]))
        if scaling.get("original_context_length"):
            params["original_max_position_embeddings"] = int(scaling["original_context_length"])
    return params
