"""The OpenAPI document tells the truth: every route's status codes and error bodies, its content
types, and the limits that depend on the served model.

Request models mark such limits with ``limit(kind)`` (a JSON-schema extra); ``ServedLimits.apply``
turns each mark into the number this server enforces (``maximum`` of a token id, ``maxItems`` of a
token-id prompt, the served model names ...), so a client generated from ``/openapi.json`` sends
what the server accepts. FastAPI's automatic 422 responses are dropped: validation errors are 400s.
"""

from __future__ import annotations

import copy
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from pagoda.errors import RequestError

LIMIT_KEY = "x-pagoda-limit"
# routes behind the API keys (and the draining/engine-failure refusals); /health, /metrics, /docs stay open
PROTECTED_PREFIXES = ("/v1/", "/api/", "/tokenize", "/detokenize")


def limit(kind: str) -> dict[str, str]:
    """``json_schema_extra`` marking a bound that ``ServedLimits`` fills in (see ``_LIMITS``)."""
    if kind not in _LIMITS:
        raise ValueError(f"unknown limit {kind!r}")
    return {LIMIT_KEY: kind}


@dataclass(frozen=True)
class ServedLimits:
    """What the served engine accepts; the same numbers the request checks use."""

    model_names: tuple[str, ...]
    vocab_size: int
    max_model_len: int
    max_n: int
    max_logprobs: int
    logits_processors: tuple[str, ...] = ()
    embedding_size: int = 1 << 20  # the model's hidden size: most `dimensions` of an embedding

    @classmethod
    def of(cls, engine, model_name: str) -> ServedLimits:
        return cls((model_name, f"{model_name}:latest"), engine.hf_config.vocab_size, engine.max_model_len,
                   engine.config.max_n, engine.config.max_logprobs, tuple(sorted(engine.controls.processors)),
                   int(getattr(engine.hf_config, "hidden_size", 0) or 1 << 20))

    def apply(self, node: Any) -> None:
        """Replace every limit mark in a JSON-schema tree (in place)."""
        if isinstance(node, dict):
            kind = node.pop(LIMIT_KEY, None)
            if kind is not None:
                for key, value in _LIMITS[kind](self).items():
                    for target in _typed_branches(node, _TYPES_OF[key]):
                        target[key] = value
            for short, key in _SHORT_BOUNDS.items():  # pydantic's spelling for a constrained Annotated alias
                if short in node and node.get("type") in ("integer", "number"):
                    node[key] = node.pop(short)
            for key in _BOUNDS:  # FastAPI writes integer bounds as floats: -1.0, and 2**63 for 2**63 - 1
                value = node.get(key)
                if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
                    node[key] = int(value)
            for child in node.values():
                self.apply(child)
        elif isinstance(node, list):
            for child in node:
                self.apply(child)


    def check(self, body: BaseModel, path: str = "") -> None:
        """Enforce the marked limits on a parsed request body, as the document states them; a value
        over one raises RequestError naming the field (``prompt[1]``, ``options.num_predict``)."""
        for name, field in type(body).model_fields.items():
            value = getattr(body, name)
            if value is not None:
                self._check(value, field.annotation, _marks(field), f"{path}{name}")

    def _check(self, value: Any, annotation: Any, marks: list[str], param: str) -> None:
        while typing.get_origin(annotation) is typing.Annotated:
            base, *meta = typing.get_args(annotation)
            marks = marks + [m for item in meta for m in _marks(item)]
            annotation = base
        for kind in marks:
            self._enforce(kind, value, param)
        origin = typing.get_origin(annotation)
        if origin in (typing.Union, types.UnionType):
            member = next((a for a in typing.get_args(annotation) if _matches(value, a)), None)
            if member is not None:
                self._check(value, member, [], param)
        elif origin is list and isinstance(value, list):
            (item,) = typing.get_args(annotation)
            for i, v in enumerate(value):
                self._check(v, item, [], f"{param}[{i}]")
        elif isinstance(value, BaseModel):
            self.check(value, f"{param}.")

    def _enforce(self, kind: str, value: Any, param: str) -> None:
        if kind in ("model", "seed"):  # an unknown model is a 404 (check_model); seeds are static bounds
            return
        bound = _LIMITS[kind](self)
        if "enum" in bound and value not in bound["enum"]:
            raise RequestError(f"{param}={value!r} is not one of this server's {', '.join(bound['enum']) or 'none'} "
                               f"({_WHY[kind]})", field=param)
        if "maximum" in bound and isinstance(value, int) and value > bound["maximum"]:
            raise RequestError(f"{param}={value} is over this server's limit of {bound['maximum']} ({_WHY[kind]})",
                               field=param)
        if "maxItems" in bound and isinstance(value, list) and len(value) > bound["maxItems"]:
            raise RequestError(f"{param} has {len(value)} items, over this server's limit of {bound['maxItems']} "
                               f"({_WHY[kind]})", field=param)


def _marks(item: Any) -> list[str]:
    extra = getattr(item, "json_schema_extra", None)
    return [extra[LIMIT_KEY]] if isinstance(extra, dict) and LIMIT_KEY in extra else []


def _matches(value: Any, annotation: Any) -> bool:
    """Whether ``value`` has the shape of one union member (the one pydantic took)."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    origin = typing.get_origin(annotation)
    if annotation is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and (not value or _matches(value[0], typing.get_args(annotation)[0]))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(annotation))
    return isinstance(annotation, type) and isinstance(value, annotation)


_WHY = {"token_id": "the model's vocabulary size - 1", "top_k": "the model's vocabulary size",
        "n": "the engine's max_n", "prompts": "the engine's max_n, completions per request",
        "logprobs": "the engine's max_logprobs",
        "output_tokens": "the model's context, max_model_len, less one prompt token",
        "prompt_tokens": "the model's context, max_model_len, less one output token",
        "logits_processor": "the engine key logits_processors",
        "dimensions": "the model's embedding size", "context_tokens": "the model's context, max_model_len"}


def _typed_branches(node: dict, types: tuple[str, ...]) -> list[dict]:
    """The schemas a keyword applies to: ``node``, or its anyOf branches of the right type (an
    optional field is ``anyOf: [{...}, {type: null}]``; its limit belongs in the first)."""
    branches = [b for b in node.get("anyOf", []) if b.get("type") in types]
    return branches or [node]


_SHORT_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_TYPES_OF = {"minimum": ("integer",), "maximum": ("integer", "number"), "maxItems": ("array",), "enum": ("string",)}

_LIMITS = {
    "token_id": lambda lim: {"maximum": lim.vocab_size - 1},
    "top_k": lambda lim: {"maximum": lim.vocab_size},
    "n": lambda lim: {"maximum": lim.max_n},
    "prompts": lambda lim: {"maxItems": lim.max_n},
    "logprobs": lambda lim: {"maximum": lim.max_logprobs},
    "output_tokens": lambda lim: {"maximum": lim.max_model_len - 1},
    "prompt_tokens": lambda lim: {"maxItems": lim.max_model_len - 1},
    "model": lambda lim: {"enum": list(lim.model_names)} if lim.model_names else {},
    "seed": lambda lim: {"minimum": -(2**63), "maximum": 2**63 - 1},  # exact (a float cannot hold 2**63 - 1)
    "logits_processor": lambda lim: {"enum": list(lim.logits_processors)},
    "dimensions": lambda lim: {"maximum": lim.embedding_size},
    "context_tokens": lambda lim: {"maximum": lim.max_model_len},
}


# ---------------------------------------------------------------------------- error bodies
class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = Field(None, description="the request field at fault, e.g. `temperature` or "
                              "`messages[0].content`")
    code: str | None = Field(None, description="a machine-readable reason, e.g. `context_length_exceeded`")


class OpenAIError(BaseModel):
    """OpenAI's error body."""

    error: OpenAIErrorDetail


class OllamaError(BaseModel):
    """Ollama's error body (``code``, where there is one, is pagoda's addition)."""

    error: str
    code: str | None = None


# Codes of 400s that a schema cannot express (relations between fields, or with the prompt's tokens).
SEMANTIC_400_CODES = ("context_length_exceeded", "invalid_combination", "chat_template_error", "invalid_prompt",
                      "invalid_grammar", "token_out_of_vocabulary", "invalid_image", "unsupported_task",
                      "untrusted_chat_template")

ERROR_STATUSES = {
    400: "Invalid request: a field of the wrong type or out of range (`param` names it), or one of the codes "
         + ", ".join(f"`{c}`" for c in SEMANTIC_400_CODES) + " (the prompt does not fit the context; fields that "
         "contradict each other; a conversation the chat template refuses; a prompt that tokenizes to nothing; "
         "a JSON schema, regex or grammar that does not compile; a logit_bias key over the vocabulary; an image "
         "that cannot be read or fetched, more images than `limit_mm_per_prompt`, or any image for a text-only "
         "model, with `param` naming the content part; a task the served model's runner does not do: generation "
         "on a pooling server, embeddings or scores on a generating one)",
    401: "API keys are configured and the request has none or a wrong one (code `invalid_api_key`)",
    404: "The model is not the one this server serves (code `model_not_found`)",
    413: "The body is larger than the server's `max_request_bytes` (code `request_too_large`)",
    429: "`max_queued_requests` requests are already waiting (code `queue_full`; header `Retry-After`)",
    500: "This request failed inside the engine (code `request_failed`); the engine and every other request "
         "went on",
    503: "The server is shutting down (code `unavailable`) or its engine failed (code `engine_failed`: the "
         "process exits non-zero moments later)",
    504: "The request ran longer than `request_timeout` and was aborted (code `timeout`)",
}

GENERATION_ERRORS = (400, 401, 404, 413, 429, 500, 503, 504)
BODY_ERRORS = (400, 401, 404, 413, 503)  # a POST that validates a body but generates nothing
READ_ERRORS = (401, 503)  # a GET under /v1 or /api


def error_responses(*statuses: int, ollama: bool = False) -> dict[int | str, dict]:
    model = OllamaError if ollama else OpenAIError
    return {status: {"model": model, "description": ERROR_STATUSES[status]} for status in statuses}


STREAMED_MODELS: list[type[BaseModel]] = []  # models named only inside stream schemas (added to components)


def json_or_stream(model: type[BaseModel], stream_type: str, stream_description: str,
                   item: type[BaseModel] | None = None) -> dict:
    """A 200 that is ``model`` as JSON, or a stream: Server-Sent Events whose ``data`` is an
    ``item`` (or an error, or ``[DONE]``), or newline-delimited JSON."""
    if stream_type == "text/event-stream" and item is not None:
        STREAMED_MODELS.append(item)
        payload = {"anyOf": [{"$ref": f"#/components/schemas/{item.__name__}"},
                             {"$ref": "#/components/schemas/OpenAIError"}]}
        data = {"anyOf": [{"const": "[DONE]"},
                          {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}
        event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    else:
        event = {"type": "string"}
    return {"model": model, "description": f"JSON when `stream` is false; {stream_description}",
            "content": {stream_type: {"schema": event}}}


# ---------------------------------------------------------------------------- the document
def served_document(base: dict, limits: ServedLimits, api_keys: bool) -> dict:
    """The app's generated document with the limits filled in, the 422s dropped, and the bearer
    scheme declared on the routes that need it when the server has API keys."""
    doc = copy.deepcopy(base)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in [*STREAMED_MODELS, OpenAIError]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas.setdefault(model.__name__, schema)
    limits.apply(doc)
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for path, operations in doc.get("paths", {}).items():
        protected = path.startswith(PROTECTED_PREFIXES)
        for operation in operations.values():
            responses = operation.get("responses", {})
            responses.pop("422", None)
            if api_keys and protected:
                operation["security"] = [{"api_key": []}]
            else:
                responses.pop("401", None)
    if api_keys:
        doc.setdefault("components", {})["securitySchemes"] = {
            "api_key": {"type": "http", "scheme": "bearer", "description": "one of the server's `api_keys`"}}
    return doc
