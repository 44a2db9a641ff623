"""Ollama-compatible routes: /api/generate, /api/chat (NDJSON streams), /api/tags, /api/show,
/api/ps, /api/version.

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
from pagoda.engine.request_stream import RequestStream
from pagoda.outputs import RequestOutput
from pagoda.server.chat_output import ChatOutput
from pagoda.server.errors import APIError, to_api_error
from pagoda.server.formatting import DeltaTracker
from pagoda.server.frontend import ClientDisconnected, Frontend, RequestStreamingResponse
from pagoda.server.media import ollama_field, ollama_image_parts, process_images, take_images
from pagoda.server.ollama_protocol import OllamaBase, OllamaChatRequest, OllamaGenerateRequest, OllamaShowRequest
from pagoda.server.openapi import BODY_ERRORS, GENERATION_ERRORS, READ_ERRORS, error_responses, json_or_stream
from pagoda.server.responses import (
    OllamaChatResponse,
    OllamaGenerateResponse,
    OllamaProcesses,
    OllamaShow,
    OllamaTags,
    OllamaVersion,
)

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
    return {"models": [{"name": fe.model_name, "model": fe.model_name, "modified_at": info["modified_at"],
                        "size": info["size"], "digest": "", "details": model_details(info)}]}


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
    images: list = []
    has_template = fe.tokenizer is not None and (fe.chat_template or getattr(fe.tokenizer, "chat_template", None))
    if body.raw or not has_template:
        text = (body.system + "\n" if body.system and not body.raw else "") + body.prompt
        ids = await fe.off_loop(fe.encode, text, add_special_tokens=not body.context, param="prompt",
                                allow_empty=bool(body.context))
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else [])
        messages.append({"role": "user", "content": ollama_image_parts(body.images, body.prompt)})
        messages, images = await take_images(fe, messages, ollama_field("images"))
        text, ids = await fe.off_loop(fe.chat_prompt_ids, messages, param="prompt",
                                      chat_template_kwargs=body.template_kwargs())
    ids = list(body.context or []) + ids
    mm_inputs = await process_images(fe, ids, ollama_images(body.images, "images", images), "prompt")
    output = ChatOutput(fe.tokenizer, fe.reasoning_parser, None, None, False, text)
    stream = await submit(fe, body, ids if mm_inputs is None else mm_inputs.prompt_token_ids, text, output, "prompt",
                          mm_inputs)
    return await respond(fe, request, body, stream, output, chat=False)


@router.post("/api/chat", response_model=None, responses={
    200: json_or_stream(OllamaChatResponse, "application/x-ndjson", NDJSON),
    **error_responses(*GENERATION_ERRORS, ollama=True)})
async def chat(body: OllamaChatRequest, request: Request) -> Response:
    fe = frontend(request)
    fe.check_request(body)
    tools = [t.model_dump() for t in body.tools] if body.tools else None
    messages, images = await take_images(fe, [m.for_template() for m in body.messages], ollama_field())
    text, ids = await fe.off_loop(fe.chat_prompt_ids, messages, tools=tools,
                                  chat_template_kwargs=body.template_kwargs())
    rename = ollama_field()
    mm_inputs = await process_images(fe, ids, [(im, rename(where)) for im, where in images], "messages")
    output = ChatOutput(fe.tokenizer, fe.reasoning_parser, fe.tool_parser if tools else None, tools, False, text)
    stream = await submit(fe, body, ids if mm_inputs is None else mm_inputs.prompt_token_ids, text, output,
                          "messages", mm_inputs)
    return await respond(fe, request, body, stream, output, chat=True)


@router.post("/api/show", response_model=OllamaShow, responses=error_responses(*BODY_ERRORS, ollama=True))
async def show(body: OllamaShowRequest, request: Request) -> dict:
    fe = frontend(request)
    fe.check_model(body.model or body.name)
    info = request.app.state.model_info
    engine = fe.async_engine.engine
    arch = info["family"]
    capabilities = ["completion"] + (["tools"] if fe.tool_parser is not None else []) + \
        (["thinking"] if fe.reasoning_parser is not None else [])
    if engine.pooling is not None:  # runner: pooling serves embeddings only (as Ollama's embedding models)
        capabilities = ["embedding"]
    return {"modelfile": f"FROM {engine.source.path}\n", "parameters": "", "license": "",
            "template": fe.chat_template or getattr(fe.tokenizer, "chat_template", None) or "",
            "details": model_details(info), "modified_at": info["modified_at"], "capabilities": capabilities,
            "model_info": {"general.architecture": arch, "general.parameter_count": info["parameter_count"],
                           f"{arch}.context_length": fe.max_model_len,
                           f"{arch}.vocab_size": engine.hf_config.vocab_size}}


@router.get("/api/ps", response_model=OllamaProcesses, responses=error_responses(*READ_ERRORS, ollama=True))
async def ps(request: Request) -> dict:
    fe = frontend(request)
    info = request.app.state.model_info
    return {"models": [{"name": fe.model_name, "model": fe.model_name, "size": info["size"], "digest": "",
                        "details": model_details(info), "expires_at": "9999-12-31T23:59:59Z",
                        "size_vram": info["size"] if fe.async_engine.engine.platform.name != "cpu" else 0,
                        "context_length": fe.max_model_len}]}


def model_details(info: dict) -> dict:
    return {"format": info["format"], "family": info["family"], "families": [info["family"]],
            "parameter_size": info["parameter_size"], "quantization_level": ""}


def ollama_images(raw: list[str] | None, field: str, taken: list) -> list:
    """The images of /api/generate with the field that names each (raw mode: straight from ``images``)."""
    if taken:
        return [(im, f"{field}[{k}]") for k, (im, _) in enumerate(taken)]
    return [(im, f"{field}[{k}]") for k, im in enumerate(raw or [])]


async def submit(fe: Frontend, body: OllamaBase, ids: list[int], text: str, output: ChatOutput, prompt_param: str,
                 mm_inputs=None):
    grammar = body.structured_params()
    if grammar is not None:
        await fe.compile_grammar(grammar, "format")
    params = fe.sampling_params(body.options.sampling_params, max_tokens=max_tokens(fe, body, len(ids), prompt_param),
                                rename=OPTION_NAMES)
    params.structured_outputs = grammar
    if output.needs_special_tokens:
        params.skip_special_tokens = False
    return await fe.submit(ids, params, text, prefix="ollama", mm_inputs=mm_inputs, model=body.model)


def reply(body: OllamaBase, message: dict, chat: bool) -> dict:
    """A reply object's text part: Ollama's message (content, thinking, tool calls with arguments
    as objects), or response (and thinking) for /api/generate."""
    out: dict = {"model": body.model, "created_at": now_iso()}
    if not chat:
        out["response"] = message.get("content") or ""
        if message.get("reasoning_content"):
            out["thinking"] = message["reasoning_content"]
        return out
    content = message.get("content") or ""
    msg: dict = {"role": "assistant", "content": content}
    if message.get("reasoning_content"):
        msg["thinking"] = message["reasoning_content"]
    calls = []
    for call in message.get("tool_calls") or ():
        try:
            arguments = json.loads(call["function"]["arguments"] or "{}")
        except ValueError:
            arguments = None
        if isinstance(arguments, dict):
            calls.append({"function": {"name": call["function"]["name"], "arguments": arguments}})
        else:  # Ollama's calls carry objects: a call whose arguments are no JSON object stays text
            msg["content"] += call["function"]["arguments"]
    if calls:
        msg["tool_calls"] = calls
    out["message"] = msg
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


async def respond(fe: Frontend, request: Request, body: OllamaBase, stream: RequestStream, output: ChatOutput,
                  chat: bool) -> Response:
    start = time.monotonic()
    if not body.stream:
        try:
            (out,) = await fe.collect(request, [stream])
        except ClientDisconnected:
            return Response(status_code=499)
        message, _ = output.message(out.outputs[0].text)
        return JSONResponse({**reply(body, message, chat), **final_fields(out, start, chat)})
    return RequestStreamingResponse(ndjson(fe, body, stream, output, chat, start), [stream],
                                    media_type="application/x-ndjson")


async def ndjson(fe: Frontend, body: OllamaBase, stream: RequestStream, output: ChatOutput, chat: bool,
                 start: float) -> AsyncIterator[str]:
    """Text as it comes (content and thinking pieces); tool calls once complete, before the last object."""
    tracker = DeltaTracker.for_stops(body.options.stop or [])
    reader = output.stream()
    calls: dict[int, dict] = {}
    final = None
    try:
        async with contextlib.aclosing(fe.follow(stream)) as outputs:
            async for out in outputs:
                final = out
                c = out.outputs[0]
                text, _, _ = tracker.delta(c)
                done = c.finish_reason is not None
                for delta in reader.feed(text, done) if text or done else []:
                    if "tool_calls" in delta:
                        for d in delta["tool_calls"]:
                            call = calls.setdefault(d["index"], {"function": {"name": "", "arguments": ""}})
                            call["function"]["name"] = d["function"].get("name") or call["function"]["name"]
                            call["function"]["arguments"] += d["function"]["arguments"]
                    else:
                        yield json.dumps(reply(body, delta, chat), ensure_ascii=False) + "\n"
        if final is None or not final.finished:
            raise APIError(503, "the request was aborted before it finished")
        if calls:
            yield json.dumps(reply(body, {"tool_calls": [calls[i] for i in sorted(calls)]}, chat),
                             ensure_ascii=False) + "\n"
        yield json.dumps({**reply(body, {}, chat), **final_fields(final, start, chat)}) + "\n"
    except Exception as exc:
        yield json.dumps(to_api_error(exc).body(ollama=True)) + "\n"
