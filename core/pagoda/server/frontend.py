"""What every generation endpoint does: check the model, build prompt token ids, check the
context length, submit to the AsyncEngine, and follow the outputs (metering them and
aborting the request when the client goes away)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagoda.engine.async_engine import AsyncEngine
from pagoda.engine.prompt_ids import truncate_prompt_ids
from pagoda.engine.request_stream import RequestStream, RequestTimeoutError
from pagoda.errors import ModelLoadError, RequestError
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.selection import get_tool_parser, select_reasoning_parser, select_tool_parser
from pagoda.server.config import ServerConfig
from pagoda.server.errors import APIError, bad_request
from pagoda.server.formatting import TokenText
from pagoda.server.metrics import ServerMetrics
from pagoda.server.openapi import ServedLimits
from pagoda.tokenizer import apply_chat_template


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


class RequestStreamingResponse(StreamingResponse):
    """A streamed response that closes its requests' streams however it ends (done, client gone,
    cancelled at shutdown, or never started), so an unfinished request is always aborted."""

    def __init__(self, content, streams: list[RequestStream], **kwargs):
        super().__init__(content, **kwargs)
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self.streams:
                stream.close()


class Frontend:
    def __init__(self, async_engine: AsyncEngine, config: ServerConfig, metrics: ServerMetrics):
        engine = async_engine.engine
        self.async_engine = async_engine
        self.config = config
        self.metrics = metrics
        self.model_name = config.served_model_name or engine.model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.created = int(time.time())
        self.token_text = TokenText(self.tokenizer)
        self.chat_template = read_chat_template(config.chat_template)
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        self.tool_parser = select_tool_parser(config.tool_call_parser, template)
        if self.tool_parser is None and config.tool_call_parser == "auto":
            self.tool_parser = get_tool_parser("hermes")  # the common open format, when the template says nothing
        self.reasoning_parser = select_reasoning_parser(engine.config.reasoning_parser, template)
        self.limits = ServedLimits.of(engine, self.model_name)
        from pagoda.server.lora_adapters import ServedAdapters, parse_lora_modules

        self.adapters = ServedAdapters(engine, self.model_name, parse_lora_modules(config.lora_modules),
                                       config.enable_lora_runtime_updates)
        self.limits = self.adapters.served_limits(self.limits, config.enable_lora_runtime_updates)
        # prompts are rendered and tokenized on this thread, not the event loop: a long prompt (tens of ms)
        # would otherwise stall every stream; one thread, so the tokenizer is used as from one caller
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagoda-tokenize")

    async def off_loop(self, fn, /, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the tokenizer thread (prompt rendering and tokenization)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, functools.partial(fn, *args, **kwargs))

    # ------------------------------------------------------------------ request checks
    def check_request(self, body) -> None:
        """What every request goes through first: its model (404 if not the served one), the
        served limits, and the fields pagoda refuses."""
        self.check_model(body.model)
        self.check_limits(body)
        body.check_unsupported()

    def check_model(self, name: str | None) -> None:
        """None means the served model (OpenAI clients always send one; curl users may not)."""
        if name is None or name in (self.model_name, f"{self.model_name}:latest") or name in self.adapters.by_name:
            return
        raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                       param="model", code="model_not_found")

    def reply_model(self, name: str | None) -> str:
        """The ``model`` of a reply: the LoRA adapter the request named, else the served model."""
        return name if name in self.adapters.by_name else self.model_name

    def check_limits(self, body) -> None:
        """The limits the document states for the served model (token ids, top_k, n, logprobs,
        output and prompt lengths), enforced on a parsed body: 400 naming the field."""
        try:
            self.limits.check(body)
        except RequestError as exc:
            raise bad_request(str(exc), param=exc.field) from exc

    def encode(self, text: str, add_special_tokens: bool, param: str, allow_empty: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids", param=param)
        try:
            ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as exc:
            raise bad_request(f"the prompt could not be tokenized: {exc}", param=param, code="invalid_prompt") from exc
        if not ids and not allow_empty:
            raise bad_request("the prompt tokenizes to no tokens", param=param, code="invalid_prompt")
        return ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, param: str = "messages",
                    tools: list[dict] | None = None, chat_template: str | None = None,
                    chat_template_kwargs: dict | None = None, continue_final_message: bool = False) -> str:
        """The prompt text of a conversation: the request's chat_template, else the server's, else the
        model's; the server's default_chat_template_kwargs under the request's."""
        if chat_template is not None and not self.config.trust_request_chat_template:
            raise bad_request("this server does not run a request's own chat_template (a template is code run on "
                              "the server); start it with --trust-request-chat-template to allow it, or use its "
                              "--chat-template", param="chat_template", code="untrusted_chat_template")
        kwargs = {**self.config.default_chat_template_kwargs, **(chat_template_kwargs or {})}
        for reserved in ("messages", "tools", "add_generation_prompt", "chat_template", "continue_final_message",
                         "tokenize", "conversation"):
            if reserved in kwargs:
                raise bad_request(f"chat_template_kwargs may not set {reserved!r}", param="chat_template_kwargs")
        try:
            return apply_chat_template(self.tokenizer, messages, add_generation_prompt, tools=tools,
                                       chat_template=chat_template or self.chat_template,
                                       continue_final_message=continue_final_message, **kwargs)
        except ModelLoadError as exc:
            raise bad_request(f"{exc}; use the completions endpoint with a plain prompt", param=param,
                              code="chat_template_error") from exc
        except Exception as exc:  # the template itself refused the conversation (roles, order ...)
            raise bad_request(f"the chat template could not render these messages: {exc}", param=param,
                              code="chat_template_error") from exc

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                        param: str = "messages", **template_options) -> tuple[str, list[int]]:
        text = self.render_chat(messages, add_generation_prompt, param, **template_options)
        return text, self.encode(text, add_special_tokens=False, param=param)  # the template has BOS

    async def compile_grammar(self, params, field: str) -> None:
        """Compile a request's grammar off the engine loop (cached); one that does not compile is a
        400 naming ``field`` before the request is queued."""
        manager = self.async_engine.engine.controls.structured_outputs
        try:
            await asyncio.wrap_future(manager.compile_async(params, field))
        except RequestError as exc:
            raise bad_request(str(exc), param=exc.field, code=exc.code) from exc

    def truncate_prompt(self, ids: list[int], keep: int | None) -> list[int]:
        """``truncate_prompt_tokens``: the prompt's last tokens (the engine's rule), before the output
        budget is worked out; over max_model_len is a 400 naming the field."""
        try:
            return truncate_prompt_ids(ids, keep, self.max_model_len)
        except RequestError as exc:
            raise bad_request(str(exc), param=exc.field) from exc

    def max_tokens(self, prompt_len: int, requested: int | None, param: str, prompt_param: str,
                   default: int | None = None) -> int:
        """Output budget; a prompt or ``requested`` that does not fit the context is a 400."""
        if prompt_len >= self.max_model_len:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens and the "
                           f"prompt has {prompt_len}, which leaves no room for output", param=prompt_param,
                           code="context_length_exceeded")
        budget = self.max_model_len - prompt_len
        if requested is None:
            return budget if default is None else min(default, budget)
        if not isinstance(requested, int) or requested < 1:
            raise bad_request(f"{param} must be an integer >= 1 (got {requested!r})", param=param)
        if requested > budget:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                           f"has {prompt_len} and {param}={requested} would exceed it (at most {budget})",
                           param=param, code="context_length_exceeded")
        return requested

    def sampling_params(self, build, rename: dict[str, str] | None = None, **kwargs) -> SamplingParams:
        """Call a protocol model's ``sampling_params`` and check it against the engine's limits; a
        bad field becomes a 400 naming it (``rename``: SamplingParams names -> request field names)."""
        try:
            params = build(**kwargs)
            self.async_engine.engine.validate_params(params)
        except RequestError as exc:
            field = (rename or {}).get(exc.field, exc.field)
            message = str(exc).replace(f"parameter {exc.field}=", f"parameter {field}=") if field else str(exc)
            raise bad_request(message, param=field, code=exc.code) from exc
        return params

    # ------------------------------------------------------------------ running requests
    async def submit(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None,
                     prefix: str = "cmpl", mm_inputs=None, model: str | None = None) -> RequestStream:
        """``model``: the request's model field (a LoRA adapter's name selects it)."""
        return await self.async_engine.add_request(prompt_ids, params, f"{prefix}-{uuid.uuid4().hex}",
                                                   prompt=prompt, timeout=self.config.request_timeout,
                                                   mm_inputs=mm_inputs, lora_request=self.adapters.get(model))

    async def follow(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """The stream's outputs (generation, or one pooling output), metered; closing early (or an error)
        aborts the request."""
        start = time.monotonic()
        first_token = None
        reason = "abort"
        try:
            async for out in stream:
                completions = out.outputs if isinstance(out.outputs, list) else []  # (pooling: none)
                if first_token is None and any(c.token_ids for c in completions):
                    first_token = time.monotonic()
                    self.metrics.ttft.observe(first_token - start)
                if out.finished:
                    reasons = {c.finish_reason for c in completions}
                    reason = "length" if reasons == {"length"} else "stop"
                yield out
        except RequestTimeoutError:
            reason = "timeout"
            raise
        except Exception:
            reason = "error"
            raise
        finally:
            stream.close()
            self.metrics.observe_request(stream.last, reason, start, first_token)

    async def collect(self, request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
        """Final outputs of ``streams``; if the client disconnects first, abort them all."""

        async def last_output(stream: RequestStream) -> RequestOutput:
            last = None
            async for out in self.follow(stream):
                last = out
            if last is None or not last.finished:
                raise APIError(503, "the request was aborted before it finished", code="aborted")
            return last

        tasks = [asyncio.ensure_future(last_output(s)) for s in streams]
        everything = asyncio.gather(*tasks)
        watcher = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({everything, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if everything in done:
                return everything.result()
            raise ClientDisconnected()
        finally:
            watcher.cancel()
            for task in tasks:
                task.cancel()  # no-op for finished ones; the others abort their request
            for s in streams:
                s.close()
            if not everything.done():
                everything.cancel()
            await asyncio.gather(everything, return_exceptions=True)


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def merge(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave several async iterators: yields (iterator index, item) as items arrive.
    An exception in one ends the merge (the others are closed)."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
            await queue.put((i, done))
        except BaseException as exc:  # noqa: B036 - forwarded to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def read_chat_template(value: str | None) -> str | None:
    """``chat_template``: a file's contents, or the template itself (one with Jinja markup)."""
    if not value:
        return None
    from pathlib import Path

    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{%" in value or "{{" in value:
        return value
    from pagoda.errors import ConfigError

    raise ConfigError(f"chat_template {value!r} (--chat-template) is neither a file nor a Jinja template")
