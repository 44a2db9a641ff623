"""Glue between the engine and ``pagoda.lora``: building the manager, checking a request."""

from __future__ import annotations

from typing import Any

import torch

from pagoda.errors import ConfigError, RequestError
from pagoda.lora.manager import LoRAManager
from pagoda.lora.peft_format import LoRAError
from pagoda.lora.request import LoRARequest


def create_lora_manager(model: torch.nn.Module, config: Any, dtype: torch.dtype, device: torch.device) -> LoRAManager:
    from pagoda.loader.weights import LLAMA_STACKED

    stacked = getattr(model, "lora_stacked", LLAMA_STACKED)  # (fused layer, checkpoint module, piece)
    manager = LoRAManager(model, stacked, config.max_loras, config.max_lora_rank, config.max_cpu_loras, dtype, device)
    if not manager.layers:
        raise ConfigError(f"enable_lora: {type(model).__name__} has no linear layers LoRA can adapt")
    return manager


def check_lora_request(engine: Any, request: Any) -> None:
    """Load (or find cached) the request's adapter; a bad one is this request's RequestError."""
    if not isinstance(request, LoRARequest):
        raise RequestError(f"lora_request must be a pagoda.lora.LoRARequest, not {type(request).__name__}",
                           field="lora_request")
    manager = getattr(engine.runner, "lora", None)
    if manager is None:
        raise RequestError(f"LoRA adapter {request.lora_name!r} requested but this engine was started without "
                           f"enable_lora (--enable-lora)", field="lora_request")
    try:
        register_lora(engine, request)
    except LoRAError as e:
        raise RequestError(str(e), field="lora_request") from None


def register_lora(engine: Any, request: LoRARequest) -> None:
    """``LLMEngine.load_lora``: load and check an adapter on rank 0, then (first time, tensor parallel) on
    every other rank, which read it from the same path and shard it. Raises LoRAError."""
    manager = engine.runner.lora
    first = request.lora_int_id not in manager.known
    manager.load(request)  # rank 0 checks it first: the other ranks then read a good adapter
    if first and hasattr(type(engine.runner), "call"):
        engine.runner.call("load_lora", request)


def remove_lora(engine: Any, lora_int_id: int) -> None:
    """``LLMEngine.remove_lora``: forget an adapter on every rank."""
    runner = engine.runner
    if hasattr(type(runner), "call"):
        runner.call("remove_lora", lora_int_id)
    else:
        runner.remove_lora(lora_int_id)
