"""Copying checkpoint tensors into a model's parameters by HF name.

Models call ``load_by_name`` from their ``load_weights``; it maps fused projections
(q/k/v → qkv_proj, gate/up → gate_up_proj), calls each parameter's ``weight_loader`` and
returns the parameter names it filled, so the loader can report any that stayed missing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
from pagoda.errors import ModelLoadError
from torch import nn

# (fused parameter part, checkpoint part, shard id) used by Llama-like models
LLAMA_STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class WeightStream:
    """An iterable of (name, tensor) that remembers which file each name came from."""

    def __init__(self, make: Callable[[dict], Iterator[tuple[str, torch.Tensor]]]):
        self.sources: dict[str, str] = {}
        self._make = make
        self.names_seen: list[str] = []

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._make(self.sources):
            self.names_seen.append(name)
            yield name, tensor

    def where(self, name: str) -> str:
        return self.sources.get(name, "checkpoint")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ModelLoadError(f"shape {tuple(loaded.shape)} does not match the parameter's "
                             f"{tuple(param.shape)}")
    param.data.copy_(loaded)


# ".experts.7.gate_proj." (one expert's tensor) or ".experts.gate_up_proj" (all experts stacked)
_EXPERT_PART = re.compile(r"\.experts\.(?:\d+\.[^.]+\.|[^.]+)")


def _expert_part(name: str, by_part: dict) -> tuple[str, tuple] | None:
    for match in _EXPERT_PART.finditer(name):
        entry = by_part.get(match.group(0))
        if entry is not None:
            return match.group(0), entry
    return None


def _kv_cache_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """FP8 checkpoints carry per-layer KV cache scales that are not parameters."""
    if not name.endswith("_scale"):
        return False
    from pagoda.layers.attention import load_kv_cache_scale

    return load_kv_cache_scale(model, name, tensor)


def load_by_name(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 stacked: Iterable[tuple[str, str, object]] = LLAMA_STACKED,
                 skip: Callable[[str], bool] | None = None,
                 rename: Callable[[str], str] | None = None,
                 experts: Iterable[tuple[str, str, int | None, str]] = ()) -> set[str]:
    """Load every tensor; an unknown name is an error naming the tensor and its file.

    ``experts``: (parameter part, checkpoint part, expert id, shard id) from
    ``pagoda.layers.moe.expert_params_mapping``, checkpoint parts shaped ``.experts.{e}.{name}.``
    or ``.experts.{name}``; tried before ``stacked``, found by a dict lookup (checkpoints hold
    tens of thousands of expert tensors); a match calls ``loader(param, tensor, shard_id, expert_id)``.
    """
    params = dict(model.named_parameters())
    where = getattr(weights, "where", lambda name: "checkpoint")
    loaded: set[str] = set()
    stacked = tuple(stacked)
    by_part = {part: (fused, expert_id, shard_id) for fused, part, expert_id, shard_id in experts}
    for name, tensor in weights:
        if skip is not None and skip(name):
            continue
        target = rename(name) if rename else name
        shard, expert = None, None
        hit = _expert_part(target, by_part) if by_part else None
        if hit is not None:
            part, (fused, expert_id, shard) = hit
            target, expert = target.replace(part, fused), (expert_id,)
        else:
            for fused, part, shard_id in stacked:
                if f".{part}." in target:
                    target, shard = target.replace(f".{part}.", f".{fused}."), shard_id
                    break
        param = params.get(target)
        if param is None and _kv_cache_scale(model, rename(name) if rename else name, tensor):
            continue
        if param is None:
            raise ModelLoadError(f"{where(name)}: tensor {name!r} does not belong to this model "
                                 f"({type(model).__name__}); is config.json from the same checkpoint?")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if expert is not None:
                loader(param, tensor, shard, expert[0])
            elif shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{where(name)}: tensor {name!r}: {exc}") from None
        loaded.add(target)
    return loaded
