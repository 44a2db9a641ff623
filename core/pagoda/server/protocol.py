"""Request bodies of the OpenAI API (pydantic), and their SamplingParams.

Every field is typed strictly (``true`` is not a number, ``"5"`` is not an integer) and bounded
where it enters: numbers by range, strings and lists by length, and the limits that depend on the
served model (token ids, ``top_k``, ``n``, ``logprobs``, output lengths) through ``limit(...)``,
which the OpenAPI document and the request checks both read (see ``pagoda.server.openapi``).
Unknown fields are ignored (clients send many optional ones); known fields that pagoda cannot
honour are refused with a 400 naming them and are left out of the document.
pagoda extensions, as in vLLM: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from pagoda.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from pagoda.server.errors import bad_request
from pagoda.server.openapi import limit

MAX_NAME_CHARS = 1024  # model names, user ids
MAX_MESSAGES = 4096

STRICT = ConfigDict(extra="ignore", strict=True, protected_namespaces=(), allow_inf_nan=False)



def integral(value: object) -> object:
    """JSON Schema counts 2.0 as an integer: take it as 2. Everything else stays for the strict
    check (``true`` and ``"2"`` are not integers)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(integral)]
TokenId = Annotated[Int, Field(ge=0, json_schema_extra=limit("token_id"))]
TokenIds = Annotated[list[TokenId], Field(min_length=1, json_schema_extra=limit("prompt_tokens"))]
OutputTokens = Annotated[Int, Field(ge=1, json_schema_extra=limit("output_tokens"))]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Seed = Annotated[Int, Field(ge=INT64_MIN, le=INT64_MAX, json_schema_extra=limit("seed"))]
ModelName = Annotated[str, Field(max_length=MAX_NAME_CHARS, json_schema_extra=limit("model"))]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = STRICT

    model: ModelName | None = Field(None, description="the served model (optional)")
    n: Int = Field(1, ge=1, json_schema_extra=limit("n"), description="completions to generate")
    temperature: float | None = Field(None, ge=0, description="0: greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    seed: Seed | None = Field(None, description="completion i of n uses seed + i")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with stream=true")
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: SkipJsonSchema[dict[str, float] | None] = None
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    # pagoda / vLLM extensions
    top_k: Int | None = Field(None, ge=-1, json_schema_extra=limit("top_k"), description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: Int = Field(0, ge=0, json_schema_extra=limit("output_tokens"))
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def check_unsupported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by pagoda", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", param="stream_options",
                              code="invalid_combination")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingParams; a bad value raises RequestError naming the field."""
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# several prompts: one request each, n completions each; max_n bounds their product
Prompts = Field(min_length=1, json_schema_extra=limit("prompts"))
Prompt = (Annotated[str, Field(min_length=1)]
          | Annotated[list[Annotated[str, Field(min_length=1)]], Prompts]
          | TokenIds
          | Annotated[list[TokenIds], Prompts])


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(description="text, a list of texts, token ids, or a list of token-id lists")
    max_tokens: OutputTokens | None = Field(None, description="default 16 (capped by the context)")
    logprobs: Int | None = Field(None, ge=0, json_schema_extra=limit("logprobs"))
    echo: bool = False
    best_of: SkipJsonSchema[int | None] = None
    suffix: SkipJsonSchema[str | None] = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported by pagoda", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of={self.best_of} is not supported (pagoda returns every one of the n "
                              f"completions; leave best_of unset or equal to n)", param="best_of")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs needs prompt logprobs, which pagoda does not compute",
                              param="echo", code="invalid_combination")

    def prompts(self, max_n: int) -> list[str | list[int]]:
        """The prompt as a list of text or token-id prompts; their completions (n each) at most max_n."""
        p = self.prompt
        if isinstance(p, str):
            prompts = [p]
        elif all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        if len(prompts) * self.n > max_n:
            raise bad_request(f"{len(prompts)} prompts x n={self.n} completions is more than this server's max_n="
                              f"{max_n} completions per request", param="prompt", code="invalid_combination")
        return prompts


# ---------------------------------------------------------------------------- chat messages
class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


Content = str | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)]


class _Message(BaseModel):
    model_config = STRICT
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = Field(None, max_length=MAX_NAME_CHARS)


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class ResponseFormatText(BaseModel):
    model_config = STRICT
    type: Literal["text"]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: OutputTokens | None = Field(None, description="default: the rest of the context")
    max_completion_tokens: OutputTokens | None = Field(None, description="OpenAI's newer name of max_tokens")
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, json_schema_extra=limit("logprobs"),
                                     description="only with logprobs=true")
    tools: SkipJsonSchema[list[dict[str, Any]] | None] = None
    tool_choice: SkipJsonSchema[Any] = None
    functions: SkipJsonSchema[list[dict[str, Any]] | None] = None
    response_format: ResponseFormatText | SkipJsonSchema[dict[str, Any]] | None = None
    add_generation_prompt: bool = True

    def check_unsupported(self) -> None:
        super().check_unsupported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise bad_request(f"{name} (function calling) is not supported by pagoda", param=name)
        if isinstance(self.response_format, dict):
            raise bad_request(f"response_format {self.response_format.get('type')!r} is not supported "
                              f"(only 'text')", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_combination")

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": message_text(m.content)}
                for m in self.messages]


def message_text(content: str | list[TextPart]) -> str:
    """A message's text: a string, or its text parts joined."""
    return content if isinstance(content, str) else "".join(part.text for part in content)
