"""POST /v1/chat/completions: the conversation through the chat template (with tools and template
options), the output's grammar (response_format, structured_outputs, or a forcing tool_choice), and
the reply read back into reasoning, content and tool calls (``chat_output``), whole or streamed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pagoda.engine.request_stream import RequestStream
from pagoda.server.chat_output import ChatOutput
from pagoda.server.chat_protocol import ChatCompletionRequest
from pagoda.server.errors import APIError, bad_request
from pagoda.server.formatting import DeltaTracker, chat_logprobs, prompt_logprobs_json, usage_sum
from pagoda.server.frontend import ClientDisconnected, Frontend
from pagoda.server.media import process_images, take_images
from pagoda.server.openai_routes import SSE, _stops, event_stream, frontend, sse
from pagoda.server.openapi import GENERATION_ERRORS, error_responses, json_or_stream
from pagoda.server.responses import ChatCompletionChunk, ChatCompletionResponse

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None, responses={
    200: json_or_stream(ChatCompletionResponse, "text/event-stream", SSE, ChatCompletionChunk),
    **error_responses(*GENERATION_ERRORS)})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    fe = frontend(request)
    fe.check_request(body)
    tools = body.tool_definitions()
    messages, images = await take_images(fe, body.conversation())  # image_url parts -> placeholders
    text, ids = await fe.off_loop(fe.chat_prompt_ids, messages, body.add_generation_prompt, tools=tools,
                                  chat_template=body.chat_template, chat_template_kwargs=body.chat_template_kwargs,
                                  continue_final_message=body.continue_final_message)
    mm_inputs = await process_images(fe, ids, images, "messages")
    if mm_inputs is not None:
        ids = mm_inputs.prompt_token_ids  # each placeholder expanded to its image's tokens
    if body.truncate_prompt_tokens is not None:
        if mm_inputs is not None:
            raise bad_request("truncate_prompt_tokens cannot cut a prompt with images",
                              param="truncate_prompt_tokens")
        ids = fe.truncate_prompt(ids, body.truncate_prompt_tokens)
    grammar, field = body.structured_params()
    if grammar is not None:
        await fe.compile_grammar(grammar, field)
    parse_calls = body.tools_enabled and not body.forces_tool_calls
    if parse_calls and fe.tool_parser is None:
        raise bad_request('tool_choice "auto" needs a tool-call parser: this server has tool_call_parser "none" '
                          '(--tool-call-parser); send tool_choice "required" or a named function',
                          param="tool_choice", code="invalid_combination")
    output = ChatOutput(fe.tokenizer, fe.reasoning_parser, fe.tool_parser if parse_calls else None, tools,
                        body.forces_tool_calls, text)
    requested, param = body.requested_max_tokens()
    max_tokens = fe.max_tokens(len(ids), requested, param, "messages")
    params = fe.sampling_params(body.sampling_params, max_tokens=max_tokens, logprobs=body.num_logprobs(),
                                structured_outputs=grammar, rename={"logprobs": "top_logprobs"})
    if output.needs_special_tokens:  # the parser's markers are special tokens: keep them in the text
        params.skip_special_tokens = False
    stream = await fe.submit(ids, params, text, prefix="chatcmpl", mm_inputs=mm_inputs,
                             model=body.model)
    rid = stream.request_id
    if body.stream:
        return event_stream(chat_events(fe, body, stream, rid, output), [stream])
    try:
        (out,) = await fe.collect(request, [stream])
    except ClientDisconnected:
        return Response(status_code=499)
    choices = []
    for c in out.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(c.token_ids, c.logprobs or [], body.top_logprobs or 0, fe.token_text)
        message, called = output.message(c.text)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                        "finish_reason": "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason})
    reply = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": fe.reply_model(body.model),
             "choices": choices, "usage": usage_sum([out])}
    if body.prompt_logprobs is not None:
        reply["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
    return JSONResponse(reply)


async def chat_events(fe: Frontend, body: ChatCompletionRequest, stream: RequestStream, rid: str,
                      output: ChatOutput) -> AsyncIterator[str]:
    created = int(time.time())
    model = fe.reply_model(body.model)
    tracker = DeltaTracker.for_stops(_stops(body.stop))
    usage_field = {"usage": None} if body.include_usage else {}
    final = None

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> str:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                    **usage_field})

    for i in range(body.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    readers = {i: output.stream() for i in range(body.n)}
    finished: set[int] = set()
    async with contextlib.aclosing(fe.follow(stream)) as outputs:
        async for out in outputs:
            final = out
            for c in out.outputs:
                if c.index in finished:
                    continue
                text, new_ids, first = tracker.delta(c)
                done = c.finish_reason is not None
                logprobs = None
                if body.logprobs and new_ids:
                    logprobs = chat_logprobs(new_ids, (c.logprobs or [])[first:], body.top_logprobs or 0,
                                             fe.token_text)
                deltas = readers[c.index].feed(text, done) if text or done else []
                if logprobs is not None and not deltas:
                    deltas = [{"content": ""}]  # the tokens' logprobs travel even when their text is held back
                for k, delta in enumerate(deltas):
                    yield chunk(c.index, delta, logprobs=logprobs if k == 0 else None)
                if done:
                    finished.add(c.index)
                    called = readers[c.index].called and c.finish_reason == "stop"
                    yield chunk(c.index, {}, finish="tool_calls" if called else c.finish_reason)
    if final is None or not final.finished:
        raise APIError(503, "the request was aborted before it finished", code="aborted")
    if body.include_usage:
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": usage_sum([final])})
