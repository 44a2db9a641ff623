"""What the routes answer with 200, as pydantic models: they only document the JSON the routes
build (``/openapi.json``), so that a client generated from the document reads real responses.
The schemathesis test checks every response against them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    parent: str | None = Field(None, description="a LoRA adapter's base model (its `root` is the adapter's "
                               "path); null for the base model")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


# ---------------------------------------------------------------------------- completions
class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str | None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="with prompt_logprobs: per prompt token")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# ---------------------------------------------------------------------------- chat
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object's text, as the model wrote it")


class ToolCallReply(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantReply(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = Field(None, description="with a reasoning parser: the model's thinking")
    tool_calls: list[ToolCallReply] | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantReply
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(None, description="with prompt_logprobs: per prompt token")


# ---------------------------------------------------------------------------- Ollama
class OllamaCalledFunction(BaseModel):
    name: str
    arguments: dict


class OllamaCall(BaseModel):
    function: OllamaCalledFunction


class OllamaReplyMessage(BaseModel):
    role: Literal["assistant"]
    content: str
    thinking: str | None = None
    tool_calls: list[OllamaCall] | None = None


class OllamaStats(BaseModel):
    """The last object of a reply (or the only one, unstreamed). Durations in nanoseconds."""

    model: str
    created_at: str
    done: bool
    done_reason: str | None = Field(None, description="stop, length, or load (an empty prompt)")
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class OllamaGenerateResponse(OllamaStats):
    response: str
    thinking: str | None = None
    context: list[int] | None = Field(None, description="prompt and output token ids, to continue from")


class OllamaChatResponse(OllamaStats):
    message: OllamaReplyMessage


class OllamaModelDetails(BaseModel):
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class OllamaModel(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: OllamaModelDetails


class OllamaTags(BaseModel):
    models: list[OllamaModel]


class OllamaShow(BaseModel):
    modelfile: str
    parameters: str
    license: str
    template: str = Field(description="the chat template")
    details: OllamaModelDetails
    model_info: dict
    capabilities: list[str]
    modified_at: str


class OllamaRunning(BaseModel):
    name: str
    model: str
    size: int
    digest: str
    details: OllamaModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class OllamaProcesses(BaseModel):
    models: list[OllamaRunning]


class OllamaVersion(BaseModel):
    version: str


class Health(BaseModel):
    status: Literal["ok", "stopping", "error"]
    model: str | None = None
    error: str | None = Field(None, description="why the engine failed (the server exits moments later)")


# ---------------------------------------------------------------------------- streamed chunks
class CompletionChunk(BaseModel):
    """One Server-Sent Event of a streamed completion (``data: {...}``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice] = Field(description="empty in the last chunk when usage is included")
    usage: Usage | None = Field(None, description="with stream_options.include_usage: null, then in the last chunk")


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str = ""


class ToolCallDelta(BaseModel):
    """A call's first delta has its id, type and name; later ones add argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One Server-Sent Event of a streamed chat completion (``data: {...}``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice] = Field(description="empty in the last chunk when usage is included")
    usage: Usage | None = Field(None, description="with stream_options.include_usage: null, then in the last chunk")
