"""ServerConfig: the ``server:`` section of a serve.yaml, ``PAGODA_*`` variables and flags.

A serve.yaml has two sections, ``engine:`` (EngineConfig) and ``server:`` (ServerConfig).
Precedence, lowest first: defaults, the file, ``PAGODA_<KEY>`` variables (``PAGODA_API_KEY``
too), flags. Errors name the file or source and the key.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagoda.config import build_config, env_overrides, read_yaml
from pagoda.errors import ConfigError

SECTIONS = ("engine", "server")


class ServerConfig(BaseModel):
    """How the HTTP server behaves. Field docs are the user documentation."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    host: str = Field("127.0.0.1", min_length=1, description="address to listen on (0.0.0.0: every "
                      "interface)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0: any free port)")
    api_keys: list[str] = Field(default_factory=list, description="accepted bearer tokens; empty: no "
                                "authentication (alias: api_key)")
    served_model_name: str | None = Field(None, description="model name the API reports and accepts; "
                                          "default: the engine's served_model_name, else the model's name")
    cors_allow_origins: list[str] = Field(default_factory=list, description="origins allowed by CORS "
                                          "(['*'] for any); empty: no CORS headers")
    max_queued_requests: int | None = Field(256, gt=0, description="most requests waiting for a seat; "
                                            "one more is refused with 429; null: no limit")
    request_timeout: float | None = Field(600.0, gt=0, description="seconds a request may take before it is "
                                          "aborted (504); null: no limit")
    shutdown_timeout: float = Field(30.0, ge=0, description="on SIGTERM, seconds in-flight requests may "
                                    "finish before they are aborted")
    max_request_bytes: int = Field(8 << 20, gt=0, description="largest request body; a larger one gets 413")
    access_log: bool = Field(False, description="log every HTTP request (uvicorn access log)")
    chat_template: str | None = Field(None, description="a Jinja chat template (a file, or the template itself) "
                                      "used instead of the model's")
    trust_request_chat_template: bool = Field(False, description="accept a chat request's own chat_template "
                                              "(it runs on the server: a hostile template can hold it for "
                                              "everyone); off: such a request is a 400")
    default_chat_template_kwargs: dict = Field(default_factory=dict, description="variables every chat request "
                                               "passes its chat template, e.g. {enable_thinking: false}; a "
                                               "request's chat_template_kwargs override them")
    tool_call_parser: str | None = Field("auto", description="how tool calls are read from the output (hermes, "
                                         "llama3_json, mistral, deepseek_v3, pythonic, a plugin's); auto: from "
                                         "the chat template, else hermes; none: tools only with a forcing "
                                         "tool_choice")
    engine_process: bool = Field(True, description="run the engine in its own process (the data-parallel "
                                 "front with one replica) instead of a thread of the server's: the HTTP server's "
                                 "work and the engine's host work then run in parallel instead of taking turns "
                                 "on one GIL; false: on a thread (one process, e.g. for a debugger)")
    # images in requests (docs/multimodal.md)
    media_fetch: bool = Field(True, description="fetch http(s) image URLs of chat image_url parts; off: only "
                              "data: URLs are accepted (a fetched URL is a 400)")
    media_fetch_timeout: float = Field(10.0, gt=0, description="seconds an image URL's download may take")
    media_max_bytes: int = Field(20 << 20, gt=0, description="largest image a URL may return")

    lora_modules: list[str] = Field(default_factory=list, description="LoRA adapters served by name, NAME=PATH "
                                    "(a PEFT adapter directory; needs enable_lora); in YAML also a mapping "
                                    "{NAME: PATH}; a request's model field selects one (docs/lora.md)")
    enable_lora_runtime_updates: bool = Field(False, description="serve POST /v1/load_lora_adapter and "
                                              "/v1/unload_lora_adapter (behind the API key), as vLLM's "
                                              "VLLM_ALLOW_RUNTIME_LORA_UPDATING")

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _lora_modules(cls, v: Any) -> Any:
        from pagoda.server.lora_adapters import parse_lora_modules

        if isinstance(v, dict):
            v = [f"{name}={path}" for name, path in v.items()]
        v = _as_list(v) if isinstance(v, str) and not v.strip().startswith("{") else ([v] if isinstance(v, str) else v)
        parse_lora_modules(v)  # a malformed entry is an error naming the key
        return [json.dumps(i) if isinstance(i, dict) else i for i in v]

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, dict) and "api_key" in data:
            data = dict(data)
            key = data.pop("api_key")
            if key is not None:
                data["api_keys"] = [*_as_list(data.get("api_keys")), *_as_list(key)]
        return data

    @field_validator("default_chat_template_kwargs", mode="before")
    @classmethod
    def _json_mapping(cls, v: Any) -> Any:
        # a JSON object from an environment variable or a flag
        if isinstance(v, str):
            import json

            try:
                v = json.loads(v)
            except ValueError as exc:
                raise ValueError(f"must be a JSON object: {exc}") from None
        return v

    @field_validator("api_keys", "cors_allow_origins", mode="before")
    @classmethod
    def _comma_list(cls, v: Any) -> Any:
        # "a,b" from an environment variable or a single flag value
        return _as_list(v)

    @field_validator("api_keys")
    @classmethod
    def _keys_not_empty(cls, v: list[str]) -> list[str]:
        if any(not k.strip() for k in v):
            raise ValueError("API keys must be non-empty strings")
        return v


def _as_list(v: Any) -> Any:
    if v is None:
        return []
    if isinstance(v, str):
        return [p.strip() for p in v.split(",") if p.strip()] if "," in v else [v]
    if isinstance(v, (int, float)):
        return [str(v)]
    return v


def read_serve_file(path: str) -> tuple[dict, dict]:
    """(engine section, server section) of a serve.yaml. A file without sections holds
    EngineConfig keys only; with sections, any other top-level key is an error."""
    data = read_yaml(path)
    if not any(s in data for s in SECTIONS):
        return data, {}
    unknown = [k for k in data if k not in SECTIONS]
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key {unknown[0]!r} (a serve config has the sections "
                          f"'engine' and 'server')")
    sections = []
    for name in SECTIONS:
        section = data.get(name) or {}
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: '{name}' must be a mapping of keys, not {type(section).__name__}")
        sections.append(section)
    return sections[0], sections[1]


def load_server_config(config_file: str | None = None, **overrides: Any) -> ServerConfig:
    """ServerConfig from the file's ``server:`` section, then ``PAGODA_*``, then ``overrides``
    (None values are ignored, so unset flags do not override the file)."""
    layers: list[tuple[str, dict]] = []
    if config_file:
        layers.append((str(config_file), read_serve_file(config_file)[1]))
    env = env_overrides(ServerConfig)
    if os.environ.get("PAGODA_API_KEY"):
        env["api_key"] = os.environ["PAGODA_API_KEY"]
    layers.append(("environment (PAGODA_*)", env))
    layers.append(("arguments", {k: v for k, v in overrides.items() if v is not None}))
    return build_config(ServerConfig, [(source, _merge_key_alias(values)) for source, values in layers])


def _merge_key_alias(values: dict) -> dict:
    """``api_key`` joins ``api_keys`` within one layer, so a later layer's keys replace it."""
    if "api_key" not in values:
        return values
    values = dict(values)
    key = values.pop("api_key")
    values["api_keys"] = [*_as_list(values.get("api_keys")), *_as_list(key)]
    return values
