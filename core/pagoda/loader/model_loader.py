"""Build a model from its source: config, architecture class, quantization, weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from pagoda.config import EngineConfig
from pagoda.errors import ConfigError, ModelLoadError
from pagoda.interfaces import QuantConfig
from pagoda.loader.source import ModelSource
from pagoda.loader.weights import WeightStream
from pagoda.selection import get_quantizer, resolve_model_class
from torch import nn


def load_config(source: ModelSource):
    if source.kind == "gguf":
        from pagoda.loader.gguf_file import open_gguf

        return open_gguf(source.path).hf_config()
    from pagoda.loader.hf import load_hf_config

    return load_hf_config(source.path)


def resolve_quant_config(hf_config, config: EngineConfig, source: ModelSource | None = None,
                         device: torch.device | None = None) -> QuantConfig | None:
    """The checkpoint's ``quantization_config`` wins; else the user's ``quantization``; else, for a
    .gguf file on the CPU (one rank), the ``gguf`` method when a plugin provides it: the file's blocks
    stay quantized (``quantization: none`` widens them to the model dtype instead)."""
    checkpoint = getattr(hf_config, "quantization_config", None)
    if checkpoint:
        if not isinstance(checkpoint, dict):
            checkpoint = checkpoint.to_dict() if hasattr(checkpoint, "to_dict") else dict(checkpoint)
        method = checkpoint.get("quant_method")
        if not method:
            raise ModelLoadError("config.json quantization_config has no 'quant_method'")
        return get_quantizer(method).from_checkpoint(checkpoint)
    setting = config.quantization
    if setting is None and source is not None and source.kind == "gguf" and device is not None \
            and device.type == "cpu" and config.tensor_parallel_size == 1:
        from pagoda.plugins import get_registry

        if "gguf" in get_registry().quantizers:
            return get_quantizer("gguf").from_user({})
    if setting is None or setting in ("none", ""):
        return None
    if isinstance(setting, str):
        return get_quantizer(setting).from_user({})
    if isinstance(setting, dict):
        method = setting.get("method") or ("mixed" if ("rules" in setting or "default" in setting) else None)
        if not method:
            raise ConfigError("quantization: a mapping needs 'method' (e.g. {method: int4, group_size: 128}) "
                              "or a policy with 'default'/'rules'")
        return get_quantizer(method).from_user(setting)
    raise ConfigError(f"quantization: expected a method name or a mapping, got {setting!r}")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def weight_stream(source: ModelSource, quant_config: QuantConfig | None = None) -> WeightStream:
    if source.kind == "gguf":
        from pagoda.loader.gguf_file import open_gguf

        # a quantization method that computes on GGUF blocks asks for them raw (``gguf_keeps_raw``)
        keeps_raw = getattr(quant_config, "gguf_keeps_raw", None)  # None: no config, or none asked
        checkpoint = open_gguf(source.path)
        return WeightStream(lambda sources: checkpoint.weights(sources, keeps_raw))
    from pagoda.loader.hf import iterate_safetensors, safetensors_files

    files = safetensors_files(source.path)
    return WeightStream(lambda sources: iterate_safetensors(files, sources))


DEVICE_DRAW_NUMEL = 1 << 24  # tensors this large are drawn on their device (a CPU draw and copy is slow)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of the right shapes (benchmarks): small normal values, norms at 1. The same seed
    and shapes give the same weights (a speculative draft with the target's shapes drafts as it)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for index, (name, param) in enumerate(model.named_parameters()):
        if not param.dtype.is_floating_point:
            continue
        if name.endswith("norm.weight") or "layernorm" in name:
            param.data.fill_(1.0)
            continue
        if param.numel() < DEVICE_DRAW_NUMEL:
            param.data.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen))
        else:  # large tensors: drawn on the device, from a generator seeded by the seed and the tensor's index
            device_gen = torch.Generator(device=param.device).manual_seed(seed * 100_003 + index)
            param.data.normal_(0.0, 0.02, generator=device_gen)


def build_model(config: EngineConfig, source: ModelSource, hf_config: Any, dtype: torch.dtype,
                device: torch.device) -> nn.Module:
    architectures = list(getattr(hf_config, "architectures", None) or [])
    pooling = getattr(config, "runner", "generate") == "pooling"
    if pooling:  # XForSequenceClassification loads into XForCausalLM (pagoda.pooling.model)
        from pagoda.pooling.model import as_pooling_model, pooling_architectures

        architectures = pooling_architectures(architectures)
    cls = resolve_model_class(architectures, str(source.path), model_impl=config.model_impl, hf_config=hf_config)
    if pooling:
        cls = as_pooling_model(cls, hf_config, config)
    quant_config = resolve_quant_config(hf_config, config, source, torch.device(device))
    begin = getattr(quant_config, "begin_loading", None)
    if begin is not None and config.load_format != "dummy":  # e.g. the GGUF method opens its packed-weight cache
        begin(source)
    with torch.device(device), default_dtype(dtype):
        model = cls(hf_config, quant_config=quant_config, prefix="")
        prepare = getattr(quant_config, "prepare_model", None)
        if prepare is not None:  # e.g. the GGUF method takes over the embedding and LM head
            prepare(model)
    model.quant_config = quant_config  # the runner asks it for a declared KV cache dtype
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        stream = weight_stream(source, quant_config)
        if config.pipeline_parallel_size > 1:  # a pipeline stage reads only its own layers' weights
            from pagoda.distributed.pipeline_parallel import skip_other_stages

            stream = skip_other_stages(model, stream)
        with torch.no_grad():
            loaded = model.load_weights(stream)
        missing = [n for n, _ in model.named_parameters() if n not in loaded]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ModelLoadError(f"{source.path}: the checkpoint lacks weights the model needs: {shown}")
    on_cpu = torch.device(device).type == "cpu"
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
            if on_cpu:
                _trim_heap()  # each layer's transient decoding memory goes before the next layer's
    finish = getattr(quant_config, "finish_loading", None)
    if finish is not None:
        finish(model)
    model.eval()
    model.requires_grad_(False)
    if on_cpu:
        _trim_heap()
    return model


def _trim_heap() -> None:
    """Give the memory that loading freed (decoded and widened tensors) back to the system: glibc keeps
    freed heap blocks in the process otherwise, and they count in its resident size."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
