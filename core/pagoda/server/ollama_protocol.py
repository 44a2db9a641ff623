"""Request bodies of the Ollama API (pydantic), and their SamplingParams; typed and bounded as
the OpenAI ones (``pagoda.server.protocol``). ``options`` keys pagoda has no use for
(``num_ctx``, ``num_thread``, ``mirostat`` ...) are ignored, as Ollama ignores what a runner lacks."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field
from pydantic.json_schema import SkipJsonSchema

from pagoda.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from pagoda.server.chat_protocol import MAX_TOOLS, Tool
from pagoda.server.errors import bad_request
from pagoda.server.openapi import limit
from pagoda.server.protocol import MAX_MESSAGES, MAX_NAME_CHARS, STRICT, Int, Seed, TokenId, integral
from pagoda.structured_outputs import StructuredOutputsParams

NumPredict = (Annotated[Literal[-1, -2], BeforeValidator(integral)]
              | Annotated[Int, Field(ge=1, json_schema_extra=limit("output_tokens"))])


class OllamaOptions(BaseModel):
    model_config = STRICT
    temperature: float | None = Field(None, ge=0, description="default 0.8")
    top_p: float | None = Field(None, gt=0, le=1, description="default 0.9")
    top_k: Int | None = Field(None, ge=-1, json_schema_extra=limit("top_k"), description="default 40; -1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    num_predict: NumPredict | None = Field(None, description="tokens to generate; -1 (infinite), -2 (fill the "
                                           "context) or absent: up to the context")
    stop: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                    Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Seed | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repeat_penalty: float | None = Field(None, gt=0)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=0.8 if self.temperature is None else self.temperature,
            top_p=0.9 if self.top_p is None else self.top_p, top_k=40 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0, seed=self.seed, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repeat_penalty is None else self.repeat_penalty,
            max_tokens=max_tokens, stop=self.stop)


class OllamaBase(BaseModel):
    model_config = STRICT
    model: str = Field(max_length=MAX_NAME_CHARS, json_schema_extra=limit("model"))
    stream: bool = True
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    format: Literal["", "json"] | dict[str, Any] | None = Field(None, description='"json", or a JSON schema the '
                                                               'output must match')
    keep_alive: int | float | str | None = Field(None, description="accepted and ignored (the model stays loaded)")
    think: bool | Literal["low", "medium", "high"] | None = Field(
        None, description="thinking models: false switches thinking off (the template's enable_thinking), a level "
        "sets reasoning_effort")

    def check_unsupported(self) -> None:
        pass

    def structured_params(self) -> StructuredOutputsParams | None:
        if not self.format:
            return None
        return StructuredOutputsParams(json_object=True) if self.format == "json" else \
            StructuredOutputsParams(json=self.format)

    def template_kwargs(self) -> dict:
        if self.think is None:
            return {}
        return {"enable_thinking": self.think} if isinstance(self.think, bool) else {"reasoning_effort": self.think}


class OllamaGenerateRequest(OllamaBase):
    prompt: str = Field("", description="empty (and no context): Ollama's 'load the model' call")
    system: str | None = None
    raw: bool = False
    template: SkipJsonSchema[str | None] = None
    context: Annotated[list[TokenId], Field(json_schema_extra=limit("prompt_tokens"))] | None = Field(
        None, description="token ids a previous response returned, to continue from")
    images: Annotated[list[str], Field(max_length=MAX_MESSAGES)] | None = Field(
        None, description="base64-encoded images (vision-language models; docs/multimodal.md)")

    def check_unsupported(self) -> None:
        if self.template:
            raise bad_request("a custom template is not supported (pagoda uses the model's chat template)",
                              param="template")


class OllamaFunctionCall(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(BaseModel):
    model_config = STRICT
    function: OllamaFunctionCall


class OllamaMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    tool_calls: Annotated[list[OllamaToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_name: str | None = Field(None, max_length=MAX_NAME_CHARS, description="tool messages: the called tool")
    images: Annotated[list[str], Field(max_length=MAX_MESSAGES)] | None = Field(
        None, description="base64-encoded images (vision-language models; docs/multimodal.md)")

    def for_template(self) -> dict:
        from pagoda.server.media import ollama_image_parts

        entry: dict[str, Any] = {"role": self.role, "content": ollama_image_parts(self.images, self.content)}
        if self.tool_calls:
            entry["tool_calls"] = [{"type": "function", "function": c.function.model_dump()} for c in self.tool_calls]
        if self.tool_name is not None:
            entry["name"] = self.tool_name
        return entry


class OllamaChatRequest(OllamaBase):
    messages: list[OllamaMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None

    def check_unsupported(self) -> None:
        pass


class OllamaShowRequest(BaseModel):
    model_config = STRICT
    model: str | None = Field(None, max_length=MAX_NAME_CHARS, json_schema_extra=limit("model"))
    name: str | None = Field(None, max_length=MAX_NAME_CHARS, json_schema_extra=limit("model"),
                             description="older clients' name of model")
    verbose: bool = False
