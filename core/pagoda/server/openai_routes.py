"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (streamed as SSE)."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagoda.engine.async_engine import RequestStream
from pagoda.outputs import RequestOutput
from pagoda.server.errors import APIError, to_api_error
from pagoda.server.formatting import DeltaTracker, chat_logprobs, completion_logprobs, usage_sum
from pagoda.server.frontend import ClientDisconnected, Frontend, RequestStreamingResponse, merge
from pagoda.server.openapi import GENERATION_ERRORS, READ_ERRORS, error_responses, json_or_stream
from pagoda.server.protocol import ChatCompletionRequest, CompletionRequest
from pagoda.server.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    ModelCard,
    ModelList,
)

router = APIRouter()


def frontend(request: Request) -> Frontend:
    return request.app.state.frontend


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


@router.get("/v1/models", response_model=ModelList, responses=error_responses(*READ_ERRORS))
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [model_card(frontend(request))]}


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=error_responses(*READ_ERRORS, 404))
async def get_model(model: str, request: Request) -> dict:
    fe = frontend(request)
    fe.check_model(model)
    return model_card(fe)


def model_card(fe: Frontend) -> dict:
    return {"id": fe.model_name, "object": "model", "created": fe.created, "owned_by": "pagoda",
            "root": fe.model_name, "max_model_len": fe.max_model_len}


async def submit_all(fe: Frontend, items: list[tuple], prefix: str) -> list[RequestStream]:
    """Submit (prompt text, ids, params) items; if one is refused, abort the ones already in."""
    streams: list[RequestStream] = []
    try:
        for text, ids, params in items:
            streams.append(await fe.submit(ids, params, text, prefix=prefix))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


# ---------------------------------------------------------------------------- completions
SSE = "Server-Sent Events when `stream` is true: `data: {chunk}` lines, then `data: [DONE]`"


@router.post("/v1/completions", response_model=None, responses={
    200: json_or_stream(CompletionResponse, "text/event-stream", SSE, CompletionChunk),
    **error_responses(*GENERATION_ERRORS)})
async def completions(body: CompletionRequest, request: Request) -> Response:
    fe = frontend(request)
    fe.check_request(body)
    prompts = body.prompts(fe.limits.max_n)
    items = []
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            text, ids = prompt, fe.encode(prompt, add_special_tokens=True, param=param)
        else:
            text, ids = None, list(prompt)
        max_tokens = fe.max_tokens(len(ids), body.max_tokens, "max_tokens", param, default=16)
        params = fe.sampling_params(body.sampling_params, max_tokens=max_tokens, logprobs=body.logprobs)
        items.append((text, ids, params))
    streams = await submit_all(fe, items, "cmpl")
    rid = f"cmpl-{uuid.uuid4().hex}"
    echo = [echo_text(fe, text, ids) if body.echo else "" for text, ids, _ in items]
    if body.stream:
        return event_stream(completion_events(fe, body, streams, rid, echo), streams)
    try:
        outs = await fe.collect(request, streams)
    except ClientDisconnected:
        return Response(status_code=499)
    choices = []
    for p, out in enumerate(outs):
        for c in out.outputs:
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(c.token_ids, c.logprobs or [], body.logprobs, fe.token_text,
                                               len(echo[p]))
            choices.append({"index": p * body.n + c.index, "text": echo[p] + c.text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason})
    return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()), "model": fe.model_name,
                         "choices": choices, "usage": usage_sum(outs)})


def echo_text(fe: Frontend, text: str | None, ids: list[int]) -> str:
    if text is not None:
        return text
    return fe.tokenizer.decode(ids) if fe.tokenizer is not None else ""


async def completion_events(fe: Frontend, body: CompletionRequest, streams: list[RequestStream], rid: str,
                            echo: list[str]) -> AsyncIterator[str]:
    created = int(time.time())
    trackers = [DeltaTracker.for_stops(_stops(body.stop)) for _ in streams]
    offsets: dict[tuple[int, int], int] = {}  # (prompt, completion) -> text offset of the next token
    finished: set[tuple[int, int]] = set()
    finals: dict[int, RequestOutput] = {}
    usage_field = {"usage": None} if body.include_usage else {}

    def chunk(choice: dict) -> str:
        return sse({"id": rid, "object": "text_completion", "created": created, "model": fe.model_name,
                    "choices": [choice], **usage_field})

    if body.echo:
        for p, text in enumerate(echo):
            for i in range(body.n):
                yield chunk({"index": p * body.n + i, "text": text, "logprobs": None, "finish_reason": None})
    async with contextlib.aclosing(merge([fe.follow(s) for s in streams])) as events:
        async for p, out in events:
            if out.finished:
                finals[p] = out
            for c in out.outputs:
                key = (p, c.index)
                if key in finished:
                    continue
                text, new_ids, first = trackers[p].delta(c)
                if c.finish_reason is not None:
                    finished.add(key)
                elif not text and not new_ids:
                    continue
                logprobs = None
                if body.logprobs is not None and new_ids:
                    offset = offsets.get(key, len(echo[p]))
                    logprobs = completion_logprobs(new_ids, (c.logprobs or [])[first:], body.logprobs,
                                                   fe.token_text, offset)
                    offsets[key] = offset + sum(len(t) for t in logprobs["tokens"])
                yield chunk({"index": p * body.n + c.index, "text": text, "logprobs": logprobs,
                             "finish_reason": c.finish_reason})
    if len(finals) < len(streams):
        raise APIError(503, "the request was aborted before it finished", code="aborted")
    if body.include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": fe.model_name,
                   "choices": [], "usage": usage_sum([finals[p] for p in sorted(finals)])})


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def event_stream(events: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    """SSE response; an error after the headers went out is sent as an ``error`` event."""

    async def body() -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
        except Exception as exc:
            yield sse(to_api_error(exc).body())
        yield sse("[DONE]")

    return RequestStreamingResponse(body(), streams, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---------------------------------------------------------------------------- chat
@router.post("/v1/chat/completions", response_model=None, responses={
    200: json_or_stream(ChatCompletionResponse, "text/event-stream", SSE, ChatCompletionChunk),
    **error_responses(*GENERATION_ERRORS)})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    fe = frontend(request)
    fe.check_request(body)
    text, ids = fe.chat_prompt_ids(body.conversation(), body.add_generation_prompt)
    requested, param = body.requested_max_tokens()
    max_tokens = fe.max_tokens(len(ids), requested, param, "messages")
    params = fe.sampling_params(body.sampling_params, max_tokens=max_tokens, logprobs=body.num_logprobs(),
                                rename={"logprobs": "top_logprobs"})
    stream = await fe.submit(ids, params, text, prefix="chatcmpl")
    rid = stream.request_id
    if body.stream:
        return event_stream(chat_events(fe, body, stream, rid), [stream])
    try:
        (out,) = await fe.collect(request, [stream])
    except ClientDisconnected:
        return Response(status_code=499)
    choices = []
    for c in out.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(c.token_ids, c.logprobs or [], body.top_logprobs or 0, fe.token_text)
        choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs, "finish_reason": c.finish_reason})
    return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                         "model": fe.model_name, "choices": choices, "usage": usage_sum([out])})


async def chat_events(fe: Frontend, body: ChatCompletionRequest, stream: RequestStream,
                      rid: str) -> AsyncIterator[str]:
    created = int(time.time())
    tracker = DeltaTracker.for_stops(_stops(body.stop))
    usage_field = {"usage": None} if body.include_usage else {}
    final = None

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> str:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": fe.model_name,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                    **usage_field})

    for i in range(body.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    finished: set[int] = set()
    async with contextlib.aclosing(fe.follow(stream)) as outputs:
        async for out in outputs:
            final = out
            for c in out.outputs:
                if c.index in finished:
                    continue
                text, new_ids, first = tracker.delta(c)
                logprobs = None
                if body.logprobs and new_ids:
                    logprobs = chat_logprobs(new_ids, (c.logprobs or [])[first:], body.top_logprobs or 0,
                                             fe.token_text)
                if text or logprobs:
                    yield chunk(c.index, {"content": text}, logprobs=logprobs)
                if c.finish_reason is not None:
                    finished.add(c.index)
                    yield chunk(c.index, {}, finish=c.finish_reason)
    if final is None or not final.finished:
        raise APIError(503, "the request was aborted before it finished", code="aborted")
    if body.include_usage:
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": fe.model_name,
                   "choices": [], "usage": usage_sum([final])})
