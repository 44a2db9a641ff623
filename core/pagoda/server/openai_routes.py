"""OpenAI-compatible routes: /v1/models and /v1/completions (streamed as SSE); the helpers chat
completions (``chat_routes``) share."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagoda.engine.request_stream import RequestStream
from pagoda.outputs import RequestOutput
from pagoda.server.errors import APIError, to_api_error
from pagoda.server.formatting import (
    DeltaTracker,
    completion_logprobs,
    merge_logprobs,
    prompt_logprobs_json,
    usage_sum,
)
from pagoda.server.frontend import ClientDisconnected, Frontend, RequestStreamingResponse, merge
from pagoda.server.openapi import GENERATION_ERRORS, READ_ERRORS, error_responses, json_or_stream
from pagoda.server.protocol import CompletionRequest
from pagoda.server.responses import CompletionChunk, CompletionResponse, ModelCard, ModelList

router = APIRouter()


def frontend(request: Request) -> Frontend:
    return request.app.state.frontend


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


@router.get("/v1/models", response_model=ModelList, responses=error_responses(*READ_ERRORS))
async def list_models(request: Request) -> dict:
    fe = frontend(request)
    return {"object": "list", "data": [model_card(fe), *fe.adapters.cards(fe.created, fe.max_model_len)]}


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=error_responses(*READ_ERRORS, 404))
async def get_model(model: str, request: Request) -> dict:
    fe = frontend(request)
    fe.check_model(model)
    adapter = next((c for c in fe.adapters.cards(fe.created, fe.max_model_len) if c["id"] == model), None)
    return adapter or model_card(fe)


def model_card(fe: Frontend) -> dict:
    return {"id": fe.model_name, "object": "model", "created": fe.created, "owned_by": "pagoda",
            "root": fe.model_name, "max_model_len": fe.max_model_len}


async def submit_all(fe: Frontend, items: list[tuple], prefix: str, model: str | None = None) -> list[RequestStream]:
    """Submit (prompt text, ids, params) items; if one is refused, abort the ones already in."""
    streams: list[RequestStream] = []
    try:
        for text, ids, params in items:
            streams.append(await fe.submit(ids, params, text, prefix=prefix, model=model))
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
    grammar = None if body.structured_outputs is None else body.structured_outputs.params()
    if grammar is not None:
        await fe.compile_grammar(grammar, f"structured_outputs.{grammar.field()}")
    items = []
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            text, ids = prompt, await fe.off_loop(fe.encode, prompt, add_special_tokens=True, param=param)
        else:
            text, ids = None, list(prompt)
        if body.truncate_prompt_tokens is not None:  # echo then shows the prompt the model saw
            text, ids = None, fe.truncate_prompt(ids, body.truncate_prompt_tokens)
        max_tokens = fe.max_tokens(len(ids), body.max_tokens, "max_tokens", param, default=16)
        params = fe.sampling_params(body.sampling_params, max_tokens=max_tokens, logprobs=body.logprobs,
                                    structured_outputs=grammar)
        if body.echo and body.logprobs is not None:  # the prompt's own logprobs, from the prefill
            params.prompt_logprobs = max(body.logprobs, params.prompt_logprobs or 0)
        items.append((text, ids, params))
    streams = await submit_all(fe, items, "cmpl", model=body.model)
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
            choice = {"index": p * body.n + c.index, "text": echo[p] + c.text,
                      "logprobs": choice_logprobs(fe, body, out, c, echo[p]), "finish_reason": c.finish_reason}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
            choices.append(choice)
    return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()),
                         "model": fe.reply_model(body.model), "choices": choices, "usage": usage_sum(outs)})


def choice_logprobs(fe: Frontend, body: CompletionRequest, out: RequestOutput, c, echo: str) -> dict | None:
    """A choice's logprobs: the output's, after the echoed prompt's (whose first entry is null)."""
    if body.logprobs is None:
        return None
    generated = completion_logprobs(c.token_ids, c.logprobs or [], body.logprobs, fe.token_text, len(echo))
    if not body.echo or out.prompt_logprobs is None:
        return generated
    prompt = completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, body.logprobs, fe.token_text, 0)
    return merge_logprobs(prompt, generated)


def echo_text(fe: Frontend, text: str | None, ids: list[int]) -> str:
    if text is not None:
        return text
    return fe.tokenizer.decode(ids) if fe.tokenizer is not None else ""


async def completion_events(fe: Frontend, body: CompletionRequest, streams: list[RequestStream], rid: str,
                            echo: list[str]) -> AsyncIterator[str]:
    created = int(time.time())
    model = fe.reply_model(body.model)
    trackers = [DeltaTracker.for_stops(_stops(body.stop)) for _ in streams]
    offsets: dict[tuple[int, int], int] = {}  # (prompt, completion) -> text offset of the next token
    finished: set[tuple[int, int]] = set()
    finals: dict[int, RequestOutput] = {}
    usage_field = {"usage": None} if body.include_usage else {}

    def chunk(choice: dict) -> str:
        return sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [choice], **usage_field})

    echoed: set[int] = set()  # prompts whose echo went out (with logprobs it waits for the prefill's)
    if body.echo and body.logprobs is None:
        for p, text in enumerate(echo):
            echoed.add(p)
            for i in range(body.n):
                yield chunk({"index": p * body.n + i, "text": text, "logprobs": None, "finish_reason": None})
    async with contextlib.aclosing(merge([fe.follow(s) for s in streams])) as events:
        async for p, out in events:
            if out.finished:
                finals[p] = out
            if body.echo and p not in echoed:
                echoed.add(p)
                logprobs = completion_logprobs(out.prompt_token_ids, out.prompt_logprobs or [], body.logprobs,
                                               fe.token_text, 0)
                for i in range(body.n):
                    yield chunk({"index": p * body.n + i, "text": echo[p], "logprobs": logprobs,
                                 "finish_reason": None})
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
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
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
