"""Ollama-compatible routes: /api/generate, /api/chat (NDJSON streams), /api/tags, /api/version.

Errors on these routes use Ollama's format, ``{"error": "message"}``. Durations are in
nanoseconds, as Ollama reports them.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

import pagoda
from pagoda.engine.async_engine import RequestStream
from pagoda.outputs import RequestOutput
from pagoda.server.errors import APIError, to_api_error
from pagoda.server.formatting import DeltaTracker
from pagoda.server.frontend import ClientDisconnected, Frontend, RequestStreamingResponse
from pagoda.server.ollama_protocol import OllamaBase, OllamaChatRequest, OllamaGenerateRequest
from pagoda.server.openapi import GENERATION_ERRORS, READ_ERRORS, error_responses, json_or_stream
from pagoda.server.responses import OllamaChatResponse, OllamaGenerateResponse, OllamaTags, OllamaVersion

router = APIRouter()


def frontend(request: Request) -> Frontend:
    return request.app.state.frontend


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


NDJSON = "newline-delimited JSON when `stream` is true (the default): one object per piece, the last with " \
         "`done: true` and the statistics"


@router.get("/api/version", response_model=OllamaVersion, responses=error_responses(*READ_ERRORS, ollama=True))
async def version() -> dict:
    return {"version": pagoda.__version__}


@router.get("/api/tags", response_model=OllamaTags, responses=error_responses(*READ_ERRORS, ollama=True))
async def tags(request: Request) -> dict:
    fe = frontend(request)
    info = request.app.state.model_info
    return {"models": [{
        "name": fe.model_name, "model": fe.model_name, "modified_at": info["modified_at"], "size": info["size"],
        "digest": "", "details": {"format": info["format"], "family": info["family"], "families": [info["family"]],
                                  "parameter_size": info["parameter_size"], "quantization_level": ""}}]}


# SamplingParams names -> Ollama's, for errors
OPTION_NAMES = {name: f"options.{name}" for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                                     "presence_penalty", "frequency_penalty")}
OPTION_NAMES.update(repetition_penalty="options.repeat_penalty", max_tokens="options.num_predict")


def max_tokens(fe: Frontend, body: OllamaBase, prompt_len: int, prompt_param: str) -> int:
    """``num_predict``: unset or negative (-1 infinite, -2 fill the context) means up to the context."""
    n = body.options.num_predict
    return fe.max_tokens(prompt_len, None if n is None or n < 0 else n, "options.num_predict", prompt_param)


@router.post("/api/generate", response_model=None, responses={
    200: json_or_stream(OllamaGenerateResponse, "application/x-ndjson", NDJSON),
    **error_responses(*GENERATION_ERRORS, ollama=True)})
async def generate(body: OllamaGenerateRequest, request: Request) -> Response:
    fe = frontend(request)
    fe.check_request(body)
    if not body.prompt and not body.context:  # Ollama's "load the model" call
        return JSONResponse({"model": body.model, "created_at": now_iso(), "response": "", "done": True,
                             "done_reason": "load"})
    has_template = fe.tokenizer is not None and getattr(fe.tokenizer, "chat_template", None)
    if body.raw or not has_template:
        text = (body.system + "\n" if body.system and not body.raw else "") + body.prompt
        ids = fe.encode(text, add_special_tokens=not body.context, param="prompt", allow_empty=bool(body.context))
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else [])
        messages.append({"role": "user", "content": body.prompt})
        text, ids = fe.chat_prompt_ids(messages, param="prompt")
    ids = list(body.context or []) + ids
    params = fe.sampling_params(body.options.sampling_params, max_tokens=max_tokens(fe, body, len(ids), "prompt"),
                                rename=OPTION_NAMES)
    stream = await fe.submit(ids, params, text, prefix="ollama")
    return await respond(fe, request, body, stream, chat=False)


@router.post("/api/chat", response_model=None, responses={
    200: json_or_stream(OllamaChatResponse, "application/x-ndjson", NDJSON),
    **error_responses(*GENERATION_ERRORS, ollama=True)})
async def chat(body: OllamaChatRequest, request: Request) -> Response:
    fe = frontend(request)
    fe.check_request(body)
    messages = [{"role": m.role, "content": m.content} for m in body.messages]
    text, ids = fe.chat_prompt_ids(messages)
    params = fe.sampling_params(body.options.sampling_params,
                                max_tokens=max_tokens(fe, body, len(ids), "messages"), rename=OPTION_NAMES)
    stream = await fe.submit(ids, params, text, prefix="ollama")
    return await respond(fe, request, body, stream, chat=True)


def piece(body: OllamaBase, text: str, chat: bool) -> dict:
    out = {"model": body.model, "created_at": now_iso()}
    if chat:
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["response"] = text
    return out


def final_fields(out: RequestOutput, start: float, chat: bool) -> dict:
    """The last object's statistics; durations from the engine's request timestamps."""
    c = out.outputs[0]
    m = out.metrics
    arrival = m.arrival_time if m else 0.0
    first = (m.first_token_time if m else None) or arrival
    end = (m.finished_time if m else None) or first
    fields = {"done": True, "done_reason": c.finish_reason or "stop",
              "total_duration": int((time.monotonic() - start) * 1e9), "load_duration": 0,
              "prompt_eval_count": len(out.prompt_token_ids), "prompt_eval_duration": int((first - arrival) * 1e9),
              "eval_count": len(c.token_ids), "eval_duration": int((end - first) * 1e9)}
    if not chat:
        fields["context"] = list(out.prompt_token_ids) + list(c.token_ids)
    return fields


async def respond(fe: Frontend, request: Request, body: OllamaBase, stream: RequestStream, chat: bool) -> Response:
    start = time.monotonic()
    if not body.stream:
        try:
            (out,) = await fe.collect(request, [stream])
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse({**piece(body, out.outputs[0].text, chat), **final_fields(out, start, chat)})
    return RequestStreamingResponse(ndjson(fe, body, stream, chat, start), [stream],
                                    media_type="application/x-ndjson")


async def ndjson(fe: Frontend, body: OllamaBase, stream: RequestStream, chat: bool,
                 start: float) -> AsyncIterator[str]:
    stops = body.options.stop or []
    tracker = DeltaTracker.for_stops(stops)
    final = None
    try:
        async with contextlib.aclosing(fe.follow(stream)) as outputs:
            async for out in outputs:
                text, _, _ = tracker.delta(out.outputs[0])
                if text:
                    yield json.dumps(piece(body, text, chat), ensure_ascii=False) + "\n"
                final = out
        if final is None or not final.finished:
            raise APIError(503, "the request was aborted before it finished")
        yield json.dumps({**piece(body, "", chat), **final_fields(final, start, chat)}) + "\n"
    except Exception as exc:
        yield json.dumps(to_api_error(exc).body(ollama=True)) + "\n"
