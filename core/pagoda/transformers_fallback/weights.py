"""Checkpoint tensors into the fallback model, through transformers' own key conversions.

A checkpoint names its tensors as transformers' modules do, except where transformers renames
or merges them on load (``conversion_mapping``: e.g. per-expert tensors stacked into one
``experts.gate_up_proj``). Renamed keys load directly; tensors that a converter merges are
collected and converted once the stream ends, then loaded. Every parameter is filled through
its ``weight_loader`` when it has one (pagoda's layers keep this rank's slice), else copied.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from pagoda.errors import ModelLoadError
from pagoda.loader.weights import default_weight_loader

# checkpoint tensors transformers computes instead of loading
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq", ".masked_bias", ".attn.bias")


def conversion_rules(hf_model: nn.Module) -> tuple[list, list]:
    """(renamings, converters) transformers applies when it loads this model's checkpoints."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # a transformers without key conversions: names are module names
        return [], []
    rules = get_model_conversion_mapping(hf_model)
    return ([r for r in rules if isinstance(r, WeightRenaming)],
            [r for r in rules if isinstance(r, WeightConverter)])


def _rename(name: str, renamings: list, converters: list) -> tuple[str, str | None]:
    if not renamings and not converters:
        return name, None
    from transformers.core_model_loading import rename_source_key

    return rename_source_key(name, renamings, converters)


def load_checkpoint(model: nn.Module, hf_model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    base_prefix: str, tied: bool) -> set[str]:
    """Load every tensor of ``weights``; returns the parameter names filled (pagoda's loader reports
    the ones left). An unknown tensor is an error naming it and its file."""
    params = dict(model.named_parameters())
    buffers = {n: b for n, b in model.named_buffers()}
    where = getattr(weights, "where", lambda name: "checkpoint")
    renamings, converters = conversion_rules(hf_model)
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    pending: dict[str, list] = {}  # target key -> [(checkpoint name, converter pattern, tensor)]
    loaded: set[str] = set()

    def target_of(name: str) -> str | None:
        for candidate in (name, f"{base_prefix}.{name}", name.removeprefix(f"{base_prefix}.")):
            if candidate in params or candidate in buffers:
                return candidate
        return None

    def put(target: str, tensor: torch.Tensor, source: str) -> None:
        if target in buffers:
            buffers[target].copy_(tensor.to(buffers[target].dtype))
            return
        param = params[target]
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is not None:
                loader(param, tensor)
            else:
                default_weight_loader(param, tensor.to(param.dtype) if tensor.is_floating_point() else tensor)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{where(source)}: tensor {source!r}: {exc}") from None
        loaded.add(target)

    for name, tensor in weights:
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        renamed, pattern = _rename(name, renamings, converters)
        if pattern is not None:
            pending.setdefault(renamed, []).append((name, pattern, tensor))
            continue
        target = target_of(renamed)
        if target is None and _kv_cache_scale(model, renamed, tensor):
            continue
        if target is None:
            raise ModelLoadError(f"{where(name)}: tensor {name!r} does not belong to transformers' "
                                 f"{type(hf_model).__name__}; is config.json from the same checkpoint?")
        put(target, tensor, name)
    for renamed, sources in pending.items():
        converter = copy.deepcopy(by_pattern[sources[0][1]])
        # in the checkpoint's natural key order (expert 2 before expert 10), as transformers stacks them
        for name, pattern, tensor in sorted(sources, key=lambda item: _natural_key(item[0])):
            converter.add_tensor(renamed, name, pattern, lambda t=tensor: t[...])
        try:
            converted = converter.convert(renamed, model=hf_model, config=hf_model.config)
        except Exception as exc:
            raise ModelLoadError(f"transformers' conversion of the checkpoint tensors of {renamed!r} failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
        for key, tensor in converted.items():
            tensor = tensor[0] if isinstance(tensor, list) else tensor
            target = target_of(key)
            if target is None:
                raise ModelLoadError(f"transformers converted checkpoint tensors into {key!r}, which "
                                     f"{type(hf_model).__name__} does not have")
            put(target, tensor, key)
    return loaded


def _natural_key(name: str) -> list:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split(".")]


def _kv_cache_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    if not name.endswith("_scale"):
        return False
    from pagoda.layers.attention import load_kv_cache_scale

    return load_kv_cache_scale(model, name, tensor)
