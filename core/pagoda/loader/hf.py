"""HF-format checkpoints: ``config.json`` and safetensors (single file or sharded)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from pagoda.errors import ModelLoadError


def load_hf_config(directory: Path):
    from transformers import AutoConfig

    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not raw.get("model_type"):
        raise ModelLoadError(f"{path} has no 'model_type' key")
    plugin_config = _plugin_config_class(raw)
    try:
        if plugin_config is not None:
            return plugin_config.from_pretrained(str(directory))
        return lift_text_config(AutoConfig.from_pretrained(str(directory)))
    except Exception as exc:
        raise ModelLoadError(f"{path} could not be read by transformers' AutoConfig "
                             f"(model_type {raw.get('model_type')!r}): {exc}") from exc


LIFTED_TEXT_KEYS = ("vocab_size", "max_position_embeddings", "eos_token_id", "bos_token_id")


def lift_text_config(config):
    """A composite config (vision-language: ``text_config`` + ``vision_config``) gets the text
    model's vocab_size, max_position_embeddings and EOS/BOS ids at its top level, where the engine
    reads them, when it lacks them there."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is config:
        return config
    for key in LIFTED_TEXT_KEYS:
        if getattr(config, key, None) is None and getattr(text, key, None) is not None:
            setattr(config, key, getattr(text, key))
    return config


def _plugin_config_class(raw: dict):
    """The config class a model plugin brings for a model type transformers does not know:
    ``HF_CONFIG_CLASS`` (a class or ``"module:Class"``) on the registered model class of the
    config's architecture. None when transformers knows the model type or no plugin brings one."""
    from transformers import CONFIG_MAPPING

    if raw["model_type"] in CONFIG_MAPPING:
        return None
    from pagoda.plugins import get_registry
    from pagoda.registry import resolve_lazy

    reg = get_registry()
    for arch in raw.get("architectures") or []:
        if arch in reg.models:
            try:
                target = getattr(resolve_lazy(reg.models.entries[arch].obj), "HF_CONFIG_CLASS", None)
                return resolve_lazy(target) if target is not None else None
            except Exception as exc:
                raise ModelLoadError(f"architecture {arch} (from {reg.models.entries[arch].provider}): its config "
                                     f"class failed to import: {type(exc).__name__}: {exc}") from exc
    return None


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = sorted({directory / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shard files that are missing: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors weights (pagoda does not load .bin "
                             f"pickles; convert them with save_pretrained(safe_serialization=True))")
    return files


def iterate_safetensors(files: list[Path], sources: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every file, recording each name's file in ``sources``."""
    from pagoda.distributed import get_tp_size
    from pagoda.loader.lazy_tensor import LazyTensor
    from safetensors import safe_open

    lazy = get_tp_size() > 1  # each rank reads only the slices it keeps
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
            names = list(handle.keys())
        except Exception as exc:
            raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from exc
        for name in names:
            sources[name] = path.name
            try:
                tensor = LazyTensor(handle.get_slice(name)) if lazy else handle.get_tensor(name)
            except Exception as exc:
                raise ModelLoadError(f"{path}: tensor {name!r} could not be read: {exc}") from exc
            yield name, tensor
