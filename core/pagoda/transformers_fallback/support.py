"""Which architectures the transformers fallback runs, and why not the others.

It runs a causal LM when transformers has a class of that name whose attention goes through
transformers' attention interface (``_supports_attention_backend``: the class lets a custom
attention function do the work), and when every layer is an attention layer: a state-space,
convolution or linear-attention layer keeps state that pagoda's paged KV cache does not hold,
ALiBi needs a bias the paged attention backends do not add, and dynamic-NTK or LongRoPE scaling is
computed in transformers from the longest position of the whole batch (one sequence's length would
change another's rotation).
"""

from __future__ import annotations

import functools
from typing import Any

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# config keys that describe layers without attention (hybrid state-space models)
HYBRID_KEYS = ("layers_block_type", "hybrid_override_pattern", "block_types", "attn_layer_indices")
# Classes transformers does not mark ``_supports_attention_backend`` although every attention
# call goes through the attention interface; pagoda's tests compare them with transformers
# (tests/test_transformers_fallback.py).
VERIFIED_WITHOUT_FLAG = frozenset({"StableLmForCausalLM"})
TEXT_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
# rope types whose transformers implementation reads the batch's longest position (dynamic_rope_update)
BATCH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})
# base_model_tp_plan styles the fallback implements (pagoda.transformers_fallback.parallel)
TP_STYLES = frozenset({"colwise", "colwise_gather_output", "colwise_rep", "packed_colwise", "rowwise", "rowwise_rep",
                       "rowwise_split_input", "replicated_with_grad_allreduce", "embedding_rowwise"})


@functools.lru_cache(maxsize=1)
def causal_lm_architectures() -> dict[str, str]:
    """Every causal-LM class name of the installed transformers -> its model type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out: dict[str, str] = {}
    for model_type, architecture in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        out.setdefault(architecture, model_type)
    return out


def causal_lm_class(architecture: str) -> Any:
    """transformers' class named ``architecture`` (None when it has no causal LM of that name)."""
    import transformers

    if architecture not in causal_lm_architectures():
        return None
    return getattr(transformers, architecture, None)


def class_unsupported_reason(architecture: str) -> str | None:
    import transformers

    if architecture not in causal_lm_architectures():
        return f"transformers {transformers.__version__} has no causal-LM class named {architecture}"
    if not architecture.endswith(TEXT_LM_SUFFIXES):
        return f"{architecture} is not a text-only causal LM class (*ForCausalLM, *LMHeadModel)"
    cls = causal_lm_class(architecture)
    if cls is None:
        return f"transformers {transformers.__version__} does not export {architecture}"
    if not (getattr(cls, "_supports_attention_backend", False) or architecture in VERIFIED_WITHOUT_FLAG):
        return (f"transformers' {architecture} does not route its attention through the attention interface "
                f"(_supports_attention_backend is not set), so it cannot run on pagoda's paged KV cache")
    return None


def config_unsupported_reason(config: Any) -> str | None:
    """Why a config describes layers the fallback cannot cache (None: it can)."""
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if hasattr(text, "add_cross_attention") and not getattr(text, "is_decoder", False):
        return "it is an encoder (its config's is_decoder is false): its attention is not causal"
    layer_types = getattr(text, "layer_types", None)
    if isinstance(layer_types, (list, tuple)):
        other = sorted({str(t) for t in layer_types if t not in ATTENTION_LAYER_TYPES})
        if other:
            return (f"its layer_types include {', '.join(other)}: only attention layers keep their state in "
                    f"pagoda's paged KV cache")
    for key in HYBRID_KEYS:
        if getattr(text, key, None):
            return f"its config sets {key}: layers without attention keep state pagoda's KV cache does not hold"
    if getattr(text, "alibi", False) or getattr(text, "position_embedding_type", None) == "alibi":
        return "it uses ALiBi position biases, which pagoda's paged attention does not add"
    batch_dependent = sorted(set(_rope_types(text)) & BATCH_DEPENDENT_ROPE)
    if batch_dependent:
        return (f"its rope_type {batch_dependent[0]} makes transformers scale the rotary frequencies by the longest "
                f"position in the whole batch, which mixes sequences under continuous batching")
    return None


def _rope_types(config: Any) -> list[str]:
    """Every rope_type of a config (``rope_parameters``/``rope_scaling``, also per layer type)."""
    found = []
    for key in ("rope_parameters", "rope_scaling"):
        params = getattr(config, key, None)
        if not isinstance(params, dict):
            continue
        nested = [v for v in params.values() if isinstance(v, dict)]
        for entry in nested or [params]:
            kind = entry.get("rope_type") or entry.get("type")
            if isinstance(kind, str):
                found.append(kind)
    return found


def unsupported_reason(architecture: str, config: Any) -> str | None:
    """None when the fallback can run ``architecture`` with ``config`` (None: not checked); otherwise why not."""
    why = class_unsupported_reason(architecture)
    return why if why is not None or config is None else config_unsupported_reason(config)


def tensor_parallel_note(config: Any) -> str:
    """``yes`` when the config's ``base_model_tp_plan`` uses only styles the fallback implements,
    else ``no`` and why."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = getattr(text, "base_model_tp_plan", None)
    if not plan:
        return "no (no base_model_tp_plan)"
    other = sorted({style for style in plan.values() if style not in TP_STYLES})
    return f"no (plan style {', '.join(other)})" if other else "yes"


def fallback_architectures() -> list[dict]:
    """Every causal LM of the installed transformers that the fallback runs with its config class's
    defaults, sorted: ``{"architecture", "model_type", "tensor_parallel"}`` (``pagoda models``)."""
    from transformers import CONFIG_MAPPING
    from transformers.utils import logging as hf_logging

    found = []
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # default configs warn about their own token ids
    try:
        for architecture, model_type in causal_lm_architectures().items():
            if class_unsupported_reason(architecture) is not None:
                continue
            try:
                defaults = CONFIG_MAPPING[model_type]()
            except Exception:  # a config class that needs arguments: decided when a checkpoint loads
                defaults = None
            if defaults is not None and config_unsupported_reason(defaults) is not None:
                continue
            note = tensor_parallel_note(defaults) if defaults is not None else "depends on the config"
            found.append({"architecture": architecture, "model_type": model_type, "tensor_parallel": note})
    finally:
        hf_logging.set_verbosity(verbosity)
    return sorted(found, key=lambda r: r["architecture"])
