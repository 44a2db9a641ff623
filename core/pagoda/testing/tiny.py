"""Tiny variants of an architecture's config, and where its transformers reference lives.

A conformance run (``pagoda check-model``) compares a pagoda model with transformers on small
random checkpoints. The configs come from the architecture's transformers config class
(its defaults) or from a user's ``config.json``; every size is shrunk to a few dozen units
while the settings that change the math (biases, tied embeddings, rope scaling, windows,
expert routing options, MLA ranks present or absent) are kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.errors import ConfigError

VOCAB = 320  # >= the byte tokenizer's 260 symbols (pagoda.testing.reference.save_byte_tokenizer)
HIDDEN, HEADS, LAYERS = 64, 4, 2
MAX_POSITIONS = 256
ORIGINAL_POSITIONS = 64  # rope scalings switch inside the prompts the checks use
WINDOW = 24
# Keys that only make sense at the original size or that config classes recompute.
DERIVED = ("layer_types", "mlp_layer_types", "qk_head_dim", "transformers_version", "_name_or_path", "dtype",
           "torch_dtype", "auto_map", "quantization_config", "id2label", "label2id")
# size fields of MoE configs (any spelling transformers uses) -> their tiny values
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass
class TinyVariant:
    """One tiny config: ``fields`` are keyword arguments of ``AutoConfig.for_model(model_type)``
    (of the reference model type); ``architecture`` goes into the saved ``config.json``."""

    name: str
    model_type: str  # the transformers model type that builds the reference and the weights
    architecture: str
    fields: dict = field(default_factory=dict)
    saved_model_type: str | None = None  # config.json's model_type when it is not model_type


def causal_lm_model_type(architecture: str) -> str | None:
    """The transformers model type whose causal-LM class is named ``architecture``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if name == architecture:
            return model_type
    return None


def known_model_type(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def reference_model_type(architecture: str, model_class: Any = None) -> str:
    """The transformers model type that computes what ``architecture`` computes: the model
    class's ``TRANSFORMERS_REFERENCE`` when it sets one (architectures transformers does not
    ship), else the model type transformers maps the architecture name to."""
    declared = getattr(model_class, "TRANSFORMERS_REFERENCE", None) if model_class is not None else None
    if declared:
        if not known_model_type(declared):
            raise ConfigError(f"{model_class.__module__}.{model_class.__name__}.TRANSFORMERS_REFERENCE = "
                              f"{declared!r} is not a model type of the installed transformers")
        return declared
    found = causal_lm_model_type(architecture)
    if found is None:
        where = f" (set TRANSFORMERS_REFERENCE on {model_class.__name__})" if model_class is not None else ""
        raise ConfigError(f"architecture {architecture}: transformers has no causal-LM class of that name, so "
                          f"there is no reference to check against{where}; name the transformers model type "
                          f"that computes the same thing, e.g. TRANSFORMERS_REFERENCE = \"llama\"")
    return found


def default_config_dict(model_type: str) -> dict:
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]().to_dict()


def _shrink_rope(params: dict | None, head_dim: int, partial_rotary_factor: float) -> dict | None:
    if not isinstance(params, dict) or not params:
        return params
    out = dict(params)
    if "original_max_position_embeddings" in out:
        out["original_max_position_embeddings"] = ORIGINAL_POSITIONS
    rotary = int(head_dim * float(out.get("partial_rotary_factor", partial_rotary_factor)))
    for key in ("short_factor", "long_factor"):  # LongRoPE: one factor per rotated frequency
        factors = out.get(key)
        if isinstance(factors, list) and factors:
            n = max(1, rotary // 2)
            out[key] = [float(factors[min(len(factors) - 1, i * len(factors) // n)]) for i in range(n)]
    return out


def _small_token_id(value):
    if isinstance(value, list):
        return [_small_token_id(v) for v in value]
    if isinstance(value, int) and value >= VOCAB:
        return 1 + value % 3
    return value


def shrink_config(source: dict, mha: bool | None = None) -> dict:
    """Keyword arguments for a tiny config with the settings of ``source`` (a config dict).

    ``mha``: True for as many KV heads as query heads, False for grouped queries (2 KV
    heads), None to keep the source's choice."""
    out = {k: v for k, v in source.items() if k not in DERIVED and k not in ("architectures", "model_type")}
    heads = source.get("num_attention_heads") or HEADS
    kv = source.get("num_key_value_heads") or heads
    keep_mha = (kv == heads) if mha is None else mha
    out.update(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               max_position_embeddings=MAX_POSITIONS)
    if "num_key_value_heads" in source:
        out["num_key_value_heads"] = HEADS if keep_mha else 2
    if "intermediate_size" in source:
        out["intermediate_size"] = 2 * HIDDEN
    mla = source.get("kv_lora_rank") is not None
    head_dim = HIDDEN // HEADS
    if mla:  # DeepSeek-style MLA: the head dims are the MLA ranks, head_dim is derived
        out.pop("head_dim", None)
        out.update(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
        if source.get("q_lora_rank") is not None:
            out["q_lora_rank"] = 32
        if source.get("index_head_dim"):  # DeepSeek sparse attention: a top-k smaller than the prompts
            out.update(index_head_dim=16, index_n_heads=8, index_topk=min(int(source.get("index_topk") or 16), 16))
        head_dim = 8
    elif source.get("head_dim"):
        explicit = source["head_dim"] * heads != source.get("hidden_size")
        head_dim = out["head_dim"] = 2 * HIDDEN // HEADS if explicit else HIDDEN // HEADS
    _shrink_experts(source, out)
    if source.get("sliding_window"):
        out["sliding_window"] = WINDOW
    if "max_window_layers" in source:
        out["max_window_layers"] = min(int(source["max_window_layers"] or 0), LAYERS - 1)
    if source.get("original_max_position_embeddings"):
        out["original_max_position_embeddings"] = ORIGINAL_POSITIONS
    for key in ("rope_parameters", "rope_scaling"):
        if key in out:
            out[key] = _shrink_rope(out[key], head_dim, source.get("partial_rotary_factor") or 1.0)
    if isinstance(source.get("layer_types"), list) and len(set(source["layer_types"])) > 1:
        out["layer_types"] = list(source["layer_types"][:LAYERS])  # a real mix: keep its first layers
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in out:
            out[key] = _small_token_id(out[key])
    return out


def _shrink_experts(source: dict, out: dict) -> None:
    for key in EXPERT_COUNTS:
        if source.get(key):
            out[key] = 8
    grouped = (source.get("n_group") or 1) > 1
    if grouped:  # grouped top-k routing: 4 groups of 4 experts, keep 2 groups
        for key in EXPERT_COUNTS:
            if source.get(key):
                out[key] = 16
        out.update(n_group=4, topk_group=2)
    elif "n_group" in source:
        out.update(n_group=1, topk_group=1)
    if source.get("num_experts_per_tok"):
        out["num_experts_per_tok"] = 3 if grouped else 2
    if source.get("moe_intermediate_size"):
        out["moe_intermediate_size"] = HIDDEN // 2
    if source.get("shared_expert_intermediate_size"):
        out["shared_expert_intermediate_size"] = 48
    if source.get("n_shared_experts"):
        out["n_shared_experts"] = min(int(source["n_shared_experts"]), 2)
    if source.get("first_k_dense_replace"):
        out["first_k_dense_replace"] = 1
    if source.get("decoder_sparse_step") and source["decoder_sparse_step"] > LAYERS:
        out["decoder_sparse_step"] = 1
    if isinstance(source.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in source["mlp_only_layers"] if i < LAYERS]


def variants_for_architecture(architecture: str, model_class: Any = None) -> list[TinyVariant]:
    """Tiny variants from the defaults of the architecture's transformers config class:
    ``gqa`` (grouped queries), ``mha-tied`` (as many KV heads as query heads, tied
    embeddings) and, for architectures with a sliding window setting, ``window``."""
    model_type = reference_model_type(architecture, model_class)
    defaults = default_config_dict(model_type)
    saved = plugin_model_type(model_class)
    # models whose layer_types mix sliding-window and global layers (Gemma, GPT-OSS) need a window
    # in their config: the first variants make every layer global, "window" alternates the two
    layered = isinstance(defaults.get("layer_types"), list) and "sliding_attention" in defaults["layer_types"]
    if layered:
        defaults = dict(defaults, sliding_window=WINDOW)
    elif "sliding_window" in defaults:  # the first variants run without a window, "window" with one
        defaults = dict(defaults, sliding_window=None)
    explicit_head_dim = "head_dim" in defaults and defaults.get("kv_lora_rank") is None
    variants = []
    if defaults.get("kv_lora_rank") is not None:  # MLA: the KV head count does not shape the cache
        variants.append(TinyVariant("base", model_type, architecture, shrink_config(defaults), saved))
        variants.append(TinyVariant("tied", model_type, architecture,
                                    dict(shrink_config(defaults), tie_word_embeddings=True), saved))
    else:
        gqa = shrink_config(defaults, mha=False)
        if explicit_head_dim:  # head_dim that is not hidden_size / heads
            gqa["head_dim"] = 2 * HIDDEN // HEADS
        variants.append(TinyVariant("gqa", model_type, architecture, gqa, saved))
        variants.append(TinyVariant("mha-tied", model_type, architecture,
                                    dict(shrink_config(defaults, mha=True), tie_word_embeddings=True), saved))
    if layered:  # shrink_config keeps only a real mix of layer types
        for variant in variants:
            variant.fields["layer_types"] = ["full_attention"] * LAYERS
    if "sliding_window" in defaults:
        window = dict(shrink_config(defaults, mha=False), sliding_window=WINDOW)
        if layered:
            window["layer_types"] = ["sliding_attention", "full_attention"]
        if "use_sliding_window" in defaults:
            window.update(use_sliding_window=True, max_window_layers=1)
        variants.append(TinyVariant("window", model_type, architecture, window, saved))
    return variants


def variant_from_config(path: str | Path, model_class: Any = None) -> TinyVariant:
    """The tiny variant of a ``config.json``: its settings at tiny sizes."""
    path = Path(path)
    try:
        source = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc}") from exc
    architectures = source.get("architectures") or []
    if not architectures:
        raise ConfigError(f"{path}: no 'architectures' list, so the model class cannot be chosen")
    architecture = architectures[0]
    own_type = source.get("model_type")
    declared = getattr(model_class, "TRANSFORMERS_REFERENCE", None)
    if not declared and own_type and known_model_type(own_type):
        model_type = own_type  # transformers implements it: that is the reference
    else:
        model_type = reference_model_type(architecture, model_class)
    return TinyVariant("config", model_type, architecture, shrink_config(source),
                       own_type if own_type and own_type != model_type else None)


def plugin_model_type(model_class: Any) -> str | None:
    """The model type of the config class a model plugin brings (``HF_CONFIG_CLASS``, for a
    model type transformers does not know), written into the tiny checkpoints' config.json."""
    target = getattr(model_class, "HF_CONFIG_CLASS", None) if model_class is not None else None
    if target is None:
        return None
    from pagoda.registry import resolve_lazy

    return getattr(resolve_lazy(target), "model_type", None) or None


def widen_weights(model, seed: int) -> None:
    """Random weights that make outputs vary: ``make_tiny_checkpoint``'s recipe, buffers included."""
    import torch

    from pagoda.testing.reference import widen_weights as widen

    torch.manual_seed(seed)
    widen(model, randomize_buffers=True)


def write_variant(variant: TinyVariant, directory: str | Path, seed: int = 0) -> Path:
    """Save a random transformers model of ``variant`` (float32 safetensors) with a byte-level
    tokenizer; config.json names ``variant.architecture`` (and ``saved_model_type``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagoda.testing.reference import save_byte_tokenizer

    directory = Path(directory)
    config = AutoConfig.for_model(variant.model_type, **variant.fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    widen_weights(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    save_byte_tokenizer(directory, config.vocab_size)
    config_path = directory / "config.json"
    saved = json.loads(config_path.read_text())
    saved["architectures"] = [variant.architecture]
    if variant.saved_model_type:
        saved["model_type"] = variant.saved_model_type
    config_path.write_text(json.dumps(saved, indent=2))
    return directory


def expected_kv_bytes_per_token(hf_config, element_size: int) -> int:
    """KV cache bytes one token takes in all layers, as the architecture implies: K and V of
    every KV head (grouped-query attention), or one latent of kv_lora_rank + qk_rope_head_dim
    values (MLA; plus the indexer's index_head_dim key with DeepSeek sparse attention)."""
    layers = hf_config.num_hidden_layers
    if getattr(hf_config, "kv_lora_rank", None):  # DeepSeek sparse attention caches the index key too
        index = getattr(hf_config, "index_head_dim", 0) or 0
        return layers * (hf_config.kv_lora_rank + hf_config.qk_rope_head_dim + index) * element_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return layers * 2 * kv_heads * head_dim * element_size

