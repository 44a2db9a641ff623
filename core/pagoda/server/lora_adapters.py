"""LoRA adapters on the server: names the request's ``model`` field selects (``--lora-modules
NAME=PATH``), their cards in ``/v1/models`` (``parent``: the base model), and vLLM's
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (only with
``enable_lora_runtime_updates``; behind the API key like every ``/v1`` route)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from pagoda.errors import ConfigError
from pagoda.lora.peft_format import LoRAError
from pagoda.lora.request import LoRARequest
from pagoda.server.errors import APIError, bad_request
from pagoda.server.openapi import BODY_ERRORS, error_responses
from pagoda.server.protocol import STRICT

router = APIRouter()


def parse_lora_modules(items: list[Any]) -> dict[str, str]:
    """``NAME=PATH`` strings (or JSON objects with ``name`` and ``path``, vLLM's other form) -> name: path."""
    found: dict[str, str] = {}
    for item in items:
        if isinstance(item, str) and item.strip().startswith("{"):
            try:
                item = json.loads(item)
            except ValueError as e:
                raise ValueError(f"lora_modules: {item!r} is not valid JSON: {e}") from None
        if isinstance(item, dict):
            name, path = item.get("name"), item.get("path")
        else:
            name, sep, path = str(item).partition("=")
            if not sep:
                name = None
        if not name or not path:
            raise ValueError(f"lora_modules: {item!r} is not NAME=PATH")
        if name in found:
            raise ValueError(f"lora_modules: the name {name!r} is given twice")
        found[name] = path
    return found


class ServedAdapters:
    """The adapters the server knows by name; ids are never reused (they key the prefix cache)."""

    def __init__(self, engine, base_name: str, modules: dict[str, str], runtime_updates: bool = False):
        self.engine, self.base_name = engine, base_name
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        for key, used in (("lora_modules (--lora-modules)", modules),
                          ("enable_lora_runtime_updates (--enable-lora-runtime-updates)", runtime_updates)):
            if used and not engine.config.enable_lora:
                raise ConfigError(f"{key} needs the engine key enable_lora (--enable-lora)")
        for name, path in modules.items():
            if name in (base_name, f"{base_name}:latest"):
                raise ConfigError(f"lora_modules: {name!r} is the base model's name")
            request = self.new(name, path)
            try:
                engine.load_lora(request)
            except LoRAError as e:
                raise ConfigError(f"lora_modules: {name}={path}: {e}") from None
            self.by_name[name] = request

    def new(self, name: str, path: str) -> LoRARequest:
        return LoRARequest(name, next(self._ids), path)

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.by_name.get(name)

    def served_limits(self, limits, runtime_updates: bool):
        """The document's ``model`` enum: the base and these adapters, or no enum when adapters
        can be loaded at runtime (the document would go stale; unknown names still get 404)."""
        if runtime_updates:
            return dataclasses.replace(limits, model_names=())
        return dataclasses.replace(limits, model_names=limits.model_names + tuple(self.by_name))

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "pagoda", "root": r.lora_path,
                 "parent": self.base_name, "max_model_len": max_model_len} for name, r in self.by_name.items()]


class LoadLoRAAdapterRequest(BaseModel):
    model_config = STRICT
    lora_name: str = Field(min_length=1, max_length=256, description="the name requests give as `model`")
    lora_path: str = Field(min_length=1, max_length=4096, description="a PEFT adapter directory on the "
                           "server (adapter_config.json + adapter_model.safetensors)")


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = STRICT
    lora_name: str = Field(min_length=1, max_length=256)


class LoRAAdapterStatus(BaseModel):
    object: str = "lora_adapter"
    id: str
    status: str = Field(description="`loaded` or `unloaded`")


@router.post("/v1/load_lora_adapter", response_model=LoRAAdapterStatus, responses=error_responses(*BODY_ERRORS))
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> dict:
    fe = request.app.state.frontend
    adapters: ServedAdapters = fe.adapters
    if body.lora_name in adapters.by_name or body.lora_name in (fe.model_name, f"{fe.model_name}:latest"):
        raise bad_request(f"a model named {body.lora_name!r} is already served", param="lora_name")
    lora = adapters.new(body.lora_name, body.lora_path)
    try:
        await fe.async_engine.call(lambda engine: engine.load_lora(lora))
    except LoRAError as e:
        raise bad_request(str(e), param="lora_path") from None
    adapters.by_name[body.lora_name] = lora
    return {"object": "lora_adapter", "id": body.lora_name, "status": "loaded"}


@router.post("/v1/unload_lora_adapter", response_model=LoRAAdapterStatus, responses=error_responses(*BODY_ERRORS))
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> dict:
    fe = request.app.state.frontend
    lora = fe.adapters.by_name.pop(body.lora_name, None)
    if lora is None:
        raise APIError(404, f"no LoRA adapter named {body.lora_name!r} is loaded", param="lora_name",
                       code="model_not_found")
    await fe.async_engine.call(lambda engine: engine.remove_lora(lora.lora_int_id))
    return {"object": "lora_adapter", "id": body.lora_name, "status": "unloaded"}
