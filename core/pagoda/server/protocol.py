"""Request bodies of the OpenAI and Ollama APIs (pydantic), and their SamplingParams.

Unknown fields are ignored (clients send many optional ones); known fields that pagoda
cannot honour (``logit_bias``, ``tools``, ``suffix`` ...) are refused with a 400 naming them.
pagoda extensions, as in vLLM: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagoda.sampling_params import SamplingParams
from pagoda.server.errors import bad_request


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # pagoda / vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def check_unsupported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by pagoda", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", param="stream_options")

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


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # OpenAI default: 16 (capped by the context)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported by pagoda", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of={self.best_of} is not supported (pagoda returns every one of the n "
                              f"completions; leave best_of unset or equal to n)", param="best_of")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs needs prompt logprobs, which pagoda does not compute",
                              param="echo")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of text or token-id prompts."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def check_unsupported(self) -> None:
        super().check_unsupported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise bad_request(f"{name} (function calling) is not supported by pagoda", param=name)
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request(f"response_format {self.response_format.get('type')!r} is not supported "
                              f"(only 'text')", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        if not self.messages:
            raise bad_request("messages must hold at least one message", param="messages")

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": message_text(m.content, f"messages[{i}].content")}
                for i, m in enumerate(self.messages)]


def message_text(content: str | list[dict[str, Any]] | None, param: str) -> str:
    """A message's text: a string, or the text parts of a content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"content part of type {part.get('type')!r} is not supported (text only)",
                              param=f"{param}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


# ---------------------------------------------------------------------------- Ollama
class OllamaOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    num_predict: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=0.8 if self.temperature is None else self.temperature,
            top_p=0.9 if self.top_p is None else self.top_p, top_k=40 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0, seed=self.seed, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repeat_penalty is None else self.repeat_penalty,
            max_tokens=max_tokens, stop=self.stop)


class OllamaBase(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())
    model: str
    stream: bool = True
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    format: Any = None
    keep_alive: Any = None

    def check_unsupported(self) -> None:
        if self.format:
            raise bad_request("format (structured output) is not supported by pagoda", param="format")


class OllamaGenerateRequest(OllamaBase):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.template:
            raise bad_request("a custom template is not supported (pagoda uses the model's chat template)",
                              param="template")
        if self.images:
            raise bad_request("images are not supported by pagoda", param="images")


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None


class OllamaChatRequest(OllamaBase):
    messages: list[OllamaMessage]
    tools: list[dict[str, Any]] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools:
            raise bad_request("tools are not supported by pagoda", param="tools")
        for i, m in enumerate(self.messages):
            if m.images:
                raise bad_request("images are not supported by pagoda", param=f"messages[{i}].images")
        if not self.messages:
            raise bad_request("messages must hold at least one message", param="messages")
