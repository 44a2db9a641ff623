"""The body of /v1/chat/completions: messages (with tool calls and tool results), tools and
tool_choice, response_format, chat template options, typed and bounded as ``pagoda.server.protocol``.

``response_format`` json_object/json_schema and a ``tool_choice`` of "required" or a named function
become a structured-output grammar (``structured_params``): JSON matching the schema, or JSON tool
calls whose arguments match the tools' ``parameters``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import SkipJsonSchema

from pagoda.server.errors import bad_request
from pagoda.server.openapi import limit
from pagoda.server.protocol import (
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    STRICT,
    Int,
    OutputTokens,
    SamplingFields,
)
from pagoda.structured_outputs import StructuredOutputsParams

MAX_TOOLS = 256
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]


# ---------------------------------------------------------------------------- messages
class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = STRICT
    url: str = Field(description="a data: URL (data:image/png;base64,...) or an http(s) URL the server fetches "
                     "(unless media_fetch is off)")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted and ignored")


class ImagePart(BaseModel):
    model_config = STRICT
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]
Content = str | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)]


class FunctionCall(BaseModel):
    model_config = STRICT
    name: FunctionName
    arguments: str = Field(max_length=1 << 20, description="the arguments as a JSON object's text")


class ToolCall(BaseModel):
    model_config = STRICT
    id: str = Field(max_length=MAX_NAME_CHARS)
    type: Literal["function"]
    function: FunctionCall


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
    content: Content | None = Field(None, description="may be null when the message makes tool calls")
    tool_calls: Annotated[list[ToolCall], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    reasoning_content: str | None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str = Field(max_length=MAX_NAME_CHARS)


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


# ---------------------------------------------------------------------------- tools and formats
class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


class ResponseFormatText(BaseModel):
    model_config = STRICT
    type: Literal["text"]


class ResponseFormatJsonObject(BaseModel):
    model_config = STRICT
    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatJsonSchema(BaseModel):
    model_config = STRICT
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
                           Field(discriminator="type")]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: OutputTokens | None = Field(None, description="default: the rest of the context")
    max_completion_tokens: OutputTokens | None = Field(None, description="OpenAI's newer name of max_tokens")
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, json_schema_extra=limit("logprobs"),
                                     description="only with logprobs=true")
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without")
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="continue the last (assistant) message")
    chat_template: str | None = Field(None, max_length=1 << 20, description="a Jinja template for this request")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="variables for the chat template, "
                                                        "e.g. {\"enable_thinking\": false}")
    functions: SkipJsonSchema[Any] = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.functions:
            raise bad_request("functions (OpenAI's deprecated form of tools) is not supported: send tools",
                              param="functions")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_combination")
        named = self.tool_choice if isinstance(self.tool_choice, NamedToolChoice) else None
        if named is not None and named.function.name not in {t.function.name for t in self.tools or ()}:
            raise bad_request(f"tool_choice names the function {named.function.name!r}, which is not in tools",
                              param="tool_choice", code="invalid_combination")
        if self.tool_choice == "required" and not self.tools:
            raise bad_request('tool_choice "required" needs tools', param="tool_choice", code="invalid_combination")
        given = [n for n in ("response_format", "structured_outputs") if self.constraint_of(n) is not None]
        if self.forces_tool_calls:
            given.append("tool_choice")
        if len(given) > 1:
            raise bad_request(f"{' and '.join(given)} each constrain the output: send one", param=given[-1],
                              code="invalid_combination")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs a last message from the assistant",
                              param="continue_final_message", code="invalid_combination")
        for i, m in enumerate(self.messages):
            if isinstance(m, AssistantMessage) and m.content is None and not m.tool_calls:
                raise bad_request("an assistant message needs content or tool_calls", param=f"messages[{i}].content",
                                  code="invalid_combination")

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    # ------------------------------------------------------------------ tools
    @property
    def tools_enabled(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_tool_calls(self) -> bool:
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    def tool_definitions(self) -> list[dict] | None:
        """The tools as the chat template takes them (OpenAI's shape)."""
        return None if not self.tools or self.tool_choice == "none" else [t.model_dump(by_alias=True)
                                                                          for t in self.tools]

    # ------------------------------------------------------------------ the output's grammar
    def constraint_of(self, name: str) -> StructuredOutputsParams | None:
        if name == "structured_outputs":
            return None if self.structured_outputs is None else self.structured_outputs.params()
        fmt = self.response_format
        if isinstance(fmt, ResponseFormatJsonObject):
            return StructuredOutputsParams(json_object=True)
        if isinstance(fmt, ResponseFormatJsonSchema):
            return StructuredOutputsParams(json=fmt.json_schema.json_schema or {"type": "object"})
        return None

    def structured_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """(the grammar the output must match, the field it comes from), if any."""
        if self.forces_tool_calls:
            return StructuredOutputsParams(json=self.tool_calls_schema()), "tool_choice"
        for name in ("response_format", "structured_outputs"):
            params = self.constraint_of(name)
            if params is not None:
                field = "response_format" if name == "response_format" else f"structured_outputs.{params.field()}"
                return params, field
        return None, None

    def tool_calls_schema(self) -> dict:
        """The JSON a forced tool call must be: a list of {"name", "parameters"} with each tool's own
        parameter schema (one named tool: exactly that one; "required": at least one call, one only
        when parallel_tool_calls is false)."""
        tools = self.tools or []
        if isinstance(self.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t.function.name == self.tool_choice.function.name]
        options = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                     "parameters": t.function.parameters or {"type": "object"}},
                    "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        single = isinstance(self.tool_choice, NamedToolChoice) or not self.parallel_tool_calls
        return {"type": "array", "items": options[0] if len(options) == 1 else {"anyOf": options},
                "minItems": 1, **({"maxItems": 1} if single else {})}

    # ------------------------------------------------------------------ the chat template's input
    def conversation(self) -> list[dict]:
        """The messages as chat templates take them: text content, tool calls with their arguments as
        objects (templates serialize them), tool results with their call ids."""
        out = []
        for m in self.messages:
            entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                     "content": message_content(m.content)}
            if isinstance(m, AssistantMessage) and m.tool_calls:
                entry["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
            if isinstance(m, ToolMessage):
                entry["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                entry["name"] = m.name
            out.append(entry)
        return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def message_text(content: str | list | None) -> str:
    """A message's text: a string, or its text parts joined (null: empty)."""
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content if isinstance(p, TextPart))


def message_content(content: str | list | None) -> str | list[dict]:
    """A message's text, or its parts as dicts when it has images (``pagoda.server.media`` takes them)."""
    if isinstance(content, list) and any(isinstance(p, ImagePart) for p in content):
        return [p.model_dump(exclude_none=True) for p in content]
    return message_text(content)
