"""transformers' attention calls, answered by pagoda's paged attention.

transformers' attention modules compute q, k and v (rotary and q/k norms included), then call
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, scaling=...,
sliding_window=..., softcap=...)``. Registering ``paged_attention_forward`` under the name
``pagoda_paged`` (``AttentionInterface.register``) and building the model with that
implementation sends every call to the ``pagoda.layers.Attention`` attached to the module:
it stores the new K/V in the paged cache and attends over the sequence's cached tokens,
reading the step's metadata from the ForwardContext. transformers builds no attention mask
for an implementation it has no mask function for, so the mask argument is None.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from pagoda.errors import ModelLoadError
from pagoda.layers.attention import Attention

IMPLEMENTATION = "pagoda_paged"
LAYER_ATTRIBUTE = "pagoda_attention"  # the paged Attention child of each transformers attention module


def register_attention_function() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, paged_attention_forward)


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Any = None, scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, softcap: float | None = None,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, head_dim], key/value [1, kv_heads, T, head_dim] (the step's flattened tokens)
    -> (attention output [1, T, heads, head_dim], no weights)."""
    layer: Attention | None = getattr(module, LAYER_ATTRIBUTE, None)
    if layer is None:
        raise ModelLoadError(f"{type(module).__name__} called the attention interface but pagoda attached no paged "
                             f"attention to it (its class name does not end in 'Attention' or it has no layer_idx)")
    if kwargs.get("s_aux") is not None:
        raise ModelLoadError(f"{type(module).__name__} uses attention sinks (s_aux), which the transformers fallback "
                             f"does not implement")
    value_dim = value.shape[3]
    if value_dim < query.shape[3]:  # smaller value heads (MLA's v_head_dim): cached padded to the key size
        value = nn.functional.pad(value, (0, query.shape[3] - value_dim))
    _adopt_call_settings(layer, module, query, key, value, scaling, sliding_window, softcap)
    tokens, heads, head_dim = query.shape[2], query.shape[1], query.shape[3]
    q = query[0].transpose(0, 1).reshape(tokens, heads * head_dim)
    k = key[0].transpose(0, 1).reshape(tokens, -1)
    v = value[0].transpose(0, 1).reshape(tokens, -1)
    layer.calls += 1
    out = layer(q, k, v).view(1, tokens, heads, head_dim)
    return (out if value_dim == head_dim else out[..., :value_dim]), None


def _adopt_call_settings(layer: Attention, module: nn.Module, query, key, value, scaling, sliding_window,
                         softcap) -> None:
    """The shapes must be what the cache was sized for; the scale, window and soft-cap are what
    transformers passes (they can differ from the module's attributes, e.g. Mistral's window)."""
    spec = layer.spec
    if query.shape[0] != 1:
        raise ModelLoadError(f"{type(module).__name__}: expected one flattened batch, got {query.shape[0]}")
    got = (query.shape[1], key.shape[1], query.shape[3], key.shape[3], value.shape[3])
    want = (spec.num_heads, spec.num_kv_heads, spec.head_size, spec.head_size, spec.head_size)
    if got != want:
        raise ModelLoadError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) passes {got[0]} query heads, "
            f"{got[1]} key/value heads and head sizes q {got[2]}, k {got[3]}, v {got[4]}; pagoda sized its KV cache "
            f"for {want[0]} / {want[1]} heads of {want[2]}")
    scale = float(scaling) if scaling is not None else spec.head_size ** -0.5
    window = int(sliding_window) if sliding_window else None
    cap = float(softcap) if softcap else None
    if (scale, window, cap) != (spec.scale, spec.sliding_window, spec.logits_soft_cap):
        layer.spec = dataclasses.replace(spec, scale=scale, sliding_window=window, logits_soft_cap=cap)


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers' attention modules: named ``*Attention`` with a ``layer_idx``."""
    return [(name, m) for name, m in model.named_modules()
            if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)]


def attach_paged_attention(module: nn.Module, config: Any, prefix: str, heads_split: int) -> Attention:
    """Add a paged ``Attention`` child to ``module``, sized from its attributes (or the config's);
    ``heads_split``: how many ranks share the heads (1 when the projections are replicated)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = _first_int(getattr(module, "num_heads", None), getattr(module, "num_attention_heads", None),
                       text.num_attention_heads)
    head_dim = _first_int(getattr(module, "qk_head_dim", None), getattr(module, "head_dim", None),
                          getattr(module, "head_size", None),
                          getattr(text, "head_dim", None),
                          text.hidden_size // text.num_attention_heads)
    groups = getattr(module, "num_key_value_groups", None)
    kv_heads = _first_int(getattr(module, "num_key_value_heads", None),
                          heads // groups if isinstance(groups, int) and groups > 0 else None,
                          getattr(text, "num_key_value_heads", None), heads)
    if getattr(module, "kv_lora_rank", None):  # MLA expands its latent into K and V for every head
        kv_heads = heads
    for what, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if count % heads_split:
            raise ModelLoadError(f"{prefix}: {count} {what} cannot be split over tensor_parallel_size={heads_split}")
    scale = getattr(module, "scaling", None)
    window = getattr(module, "sliding_window", None)
    cap = getattr(module, "attn_logit_softcapping", None)
    layer = Attention(heads // heads_split, head_dim, float(scale) if scale else head_dim ** -0.5,
                      kv_heads // heads_split, sliding_window=window if isinstance(window, int) and window else None,
                      logits_soft_cap=float(cap) if cap else None, prefix=f"{prefix}.attn")
    layer.calls = 0  # attention calls counted for the first forward's check (one per layer)
    module.add_module(LAYER_ATTRIBUTE, layer)
    return layer


def _first_int(*values) -> int:
    return next(int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0)
