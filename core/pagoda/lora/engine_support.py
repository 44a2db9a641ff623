"""Glue between the engine and ``pagoda.lora``: building the manager, checking a request."""

from __future__ import annotations

from typing import Any

import torch

from pagoda.errors import ConfigError, RequestError
from pagoda.lora.manager import LoRAManager
from pagoda.lora.peft_format import LoRAError
from pagoda.lora.request import LoRARequest


def create_lora_manager(model: torch.nn.Module, config: Any, dtype: torch.dtype, device: torch.device) -> LoRAManager:
    from pagoda.distributed import get_tp_size
    from pagoda.loader.weights import LLAMA_STACKED

    if config.tensor_parallel_size > 1 or get_tp_size() > 1:
        raise ConfigError("enable_lora: LoRA adapters are not served with tensor_parallel_size > 1 yet (the layers "
                          "shard A and B, but steps do not carry adapters to the other ranks); use one device")
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
        manager.load(request)
    except LoRAError as e:
        raise RequestError(str(e), field="lora_request") from None
