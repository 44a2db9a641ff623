"""Request and response bodies of the pooling routes: OpenAI's /v1/embeddings, vLLM's /v1/score,
Jina/Cohere's /v1/rerank, Ollama's /api/embed and /api/embeddings. Typed and bounded as the other
protocol models (``pagoda.server.protocol``); token-id inputs are not bounded by the context here,
since ``truncate_prompt_tokens`` may shorten them (one over the context is a 400 naming it)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from pagoda.server.ollama_protocol import OllamaOptions
from pagoda.server.openapi import limit
from pagoda.server.protocol import MAX_NAME_CHARS, STRICT, Int, ModelName, TokenId, Truncate

MAX_INPUTS = 2048  # texts (or token-id lists) of one request
MAX_INPUT_TOKENS = 1 << 20
Text = Annotated[str, Field(max_length=1 << 22)]
InputIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_INPUT_TOKENS)]
Texts = Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
Dimensions = Annotated[Int, Field(ge=1, json_schema_extra=limit("dimensions"),
                                  description="keep the first N dimensions (Matryoshka), then normalize")]


class EmbeddingRequest(BaseModel):
    model_config = STRICT
    model: ModelName | None = None
    input: Text | Texts | InputIds | Annotated[list[InputIds], Field(min_length=1, max_length=MAX_INPUTS)] = \
        Field(description="a text, texts, token ids, or lists of token ids")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each embedding as the base64 of its little-endian float32 bytes")
    dimensions: Dimensions | None = None
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    truncate_prompt_tokens: Truncate | None = None
    normalize: bool | None = Field(None, description="L2-normalize (default: the server's)")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: PoolingUsage


class ScoreRequest(BaseModel):
    """vLLM's /v1/score: one text_1 against each text_2, or the pairs of two lists of one length."""

    model_config = STRICT
    model: ModelName | None = None
    text_1: Text | Texts
    text_2: Text | Texts
    truncate_prompt_tokens: Truncate | None = None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(BaseModel):
    model_config = STRICT
    text: Text


class RerankRequest(BaseModel):
    """Jina's and Cohere's /v1/rerank: documents as strings or as objects with ``text``."""

    model_config = STRICT
    model: ModelName | None = None
    query: Text
    documents: Texts | Annotated[list[RerankDocument], Field(min_length=1, max_length=MAX_INPUTS)]
    top_n: Int | None = Field(None, ge=1, description="return the best N (default: every document)")
    return_documents: bool = True
    truncate_prompt_tokens: Truncate | None = None


class RerankResult(BaseModel):
    index: int = Field(description="the document's place in the request")
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult] = Field(description="best first")


class OllamaEmbedRequest(BaseModel):
    model_config = STRICT
    model: ModelName
    input: Text | Texts
    truncate: bool = Field(True, description="keep the last tokens of an input over the context (false: a 400)")
    dimensions: Dimensions | None = None
    options: OllamaOptions | None = Field(None, description="accepted; none of its keys applies to embeddings")
    keep_alive: int | float | str | None = Field(None, description="accepted and ignored (the model stays loaded)")


class OllamaEmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaEmbeddingsRequest(BaseModel):
    """Ollama's older /api/embeddings: one prompt."""

    model_config = STRICT
    model: ModelName
    prompt: Text
    options: OllamaOptions | None = Field(None, description="accepted; none of its keys applies to embeddings")
    keep_alive: int | float | str | None = Field(None, description="accepted and ignored (the model stays loaded)")


class OllamaEmbeddingsResponse(BaseModel):
    embedding: list[float]
