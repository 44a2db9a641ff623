"""Pooling routes: /v1/embeddings (OpenAI), /v1/score (vLLM), /v1/rerank (Jina/Cohere), /api/embed
and /api/embeddings (Ollama), served by an engine with ``runner: pooling`` (docs/pooling.md).

Each input is one engine request (``PoolingParams``); they run in the same batches as everything
else and the response waits for all of them (a client that leaves aborts them). A server whose
engine generates text answers these routes with a 400 (code ``unsupported_task``) saying how to
start a pooling server, and a pooling server answers the generation routes the same way.
"""

from __future__ import annotations

import base64
import time
import uuid

import torch
from fastapi import APIRouter, Request

from pagoda.errors import RequestError
from pagoda.pooling.engine import UNSUPPORTED, fit_prompt
from pagoda.pooling.offline import pair_token_ids, pair_up
from pagoda.pooling.params import PoolingParams
from pagoda.server.errors import APIError, bad_request
from pagoda.server.frontend import Frontend
from pagoda.server.openapi import GENERATION_ERRORS, error_responses
from pagoda.server.pooling_protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    OllamaEmbeddingsRequest,
    OllamaEmbeddingsResponse,
    OllamaEmbedRequest,
    OllamaEmbedResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)

router = APIRouter()


def pooling_of(fe: Frontend, route: str):
    pooling = fe.async_engine.engine.pooling
    if pooling is None:
        raise APIError(400, f"{route} needs a pooling model and this server generates text with "
                       f"{fe.model_name!r} (runner: generate); start a pooling server: pagoda serve --model MODEL "
                       f"--runner pooling", param="model", code=UNSUPPORTED)
    return pooling


def tokenize_inputs(fe: Frontend, inputs, param: str, truncate: int | None) -> list[list[int]]:
    """Token ids of each input (text, or ids as given), fitted to the context; errors name ``param[i]``."""
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
        inputs, names = [inputs], [param]
    else:
        names = [f"{param}[{i}]" for i in range(len(inputs))]
    found = []
    for name, item in zip(names, inputs):
        ids = fe.encode(item, add_special_tokens=True, param=name) if isinstance(item, str) else list(item)
        found.append(fit(fe, ids, truncate, name))
    return found


def fit(fe: Frontend, ids: list[int], truncate: int | None, name: str) -> list[int]:
    try:
        return fit_prompt(ids, fe.max_model_len, truncate, name)
    except RequestError as exc:
        raise bad_request(str(exc), param=exc.field, code=exc.code) from exc


async def pool(fe: Frontend, request: Request, prompts: list[list[int]], params: PoolingParams) -> list[torch.Tensor]:
    """Run every prompt; their pooled outputs in order (metered as requests). A client that leaves aborts
    them all."""
    streams = []
    try:
        for ids in prompts:
            streams.append(await fe.submit(ids, params, prefix="pool"))
        return [out.outputs.data for out in await fe.collect(request, streams)]
    finally:
        for stream in streams:
            stream.close()


async def pair_scores(fe: Frontend, request: Request, pairs: list[tuple[str, str]], truncate: int | None,
                      param: str) -> tuple[list[float], int]:
    """A score per (a, b) pair and the tokens computed: the score head on the pair's encoding, or the
    cosine similarity of the two embeddings for an embedding model."""
    pooling = pooling_of(fe, "scoring")
    if pooling.head is not None:
        if pooling.head.num_labels != 1:
            raise bad_request(f"scores need a model with one label; this one has {pooling.head.num_labels} "
                              f"(a classifier)", param="model", code=UNSUPPORTED)
        prompts = [fit(fe, pair_ids(fe, a, b, f"{param}[{i}]"), truncate, f"{param}[{i}]")
                   for i, (a, b) in enumerate(pairs)]
        data = await pool(fe, request, prompts, PoolingParams(task="score", truncate_prompt_tokens=truncate))
        return [float(d[0]) for d in data], sum(map(len, prompts))
    firsts = tokenize_inputs(fe, [a for a, _ in pairs], param, truncate)
    seconds = tokenize_inputs(fe, [b for _, b in pairs], param, truncate)
    data = await pool(fe, request, firsts + seconds, PoolingParams(task="embed", truncate_prompt_tokens=truncate))
    n = len(pairs)
    scores = [float(torch.nn.functional.cosine_similarity(data[i], data[n + i], dim=0)) for i in range(n)]
    return scores, sum(map(len, firsts + seconds))


def pair_ids(fe: Frontend, a: str, b: str, name: str) -> list[int]:
    if fe.tokenizer is None:
        raise bad_request("this model has no tokenizer: texts cannot be scored", param=name)
    ids = pair_token_ids(fe.tokenizer, a, b)
    if not ids:
        raise bad_request("the pair of texts tokenizes to no tokens", param=name, code="invalid_prompt")
    return ids


def embed_params(fe: Frontend, dimensions: int | None, normalize: bool | None, truncate: int | None) -> PoolingParams:
    pooling = pooling_of(fe, "embeddings")
    if dimensions is not None and dimensions > pooling.hidden_size:
        raise bad_request(f"dimensions={dimensions} is over this model's embedding size {pooling.hidden_size}",
                          param="dimensions")
    return PoolingParams(task="embed", dimensions=dimensions, normalize=normalize, truncate_prompt_tokens=truncate)


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=error_responses(*GENERATION_ERRORS))
async def embeddings(body: EmbeddingRequest, request: Request) -> dict:
    fe: Frontend = request.app.state.frontend
    fe.check_model(body.model)
    fe.check_limits(body)
    params = embed_params(fe, body.dimensions, body.normalize, body.truncate_prompt_tokens)
    prompts = tokenize_inputs(fe, body.input, "input", body.truncate_prompt_tokens)
    data = await pool(fe, request, prompts, params)
    tokens = sum(map(len, prompts))
    items = []
    for i, vector in enumerate(data):
        if body.encoding_format == "base64":
            embedding = base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
        else:
            embedding = vector.tolist()
        items.append({"object": "embedding", "index": i, "embedding": embedding})
    return {"object": "list", "data": items, "model": fe.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/v1/score", response_model=ScoreResponse, responses=error_responses(*GENERATION_ERRORS))
async def score(body: ScoreRequest, request: Request) -> dict:
    fe: Frontend = request.app.state.frontend
    fe.check_model(body.model)
    fe.check_limits(body)
    try:
        pairs = pair_up(body.text_1, body.text_2)
    except ValueError as exc:
        raise bad_request(str(exc), param="text_1", code="invalid_combination") from exc
    scores, tokens = await pair_scores(fe, request, pairs, body.truncate_prompt_tokens, "text_2")
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": fe.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/v1/rerank", response_model=RerankResponse, responses=error_responses(*GENERATION_ERRORS))
async def rerank(body: RerankRequest, request: Request) -> dict:
    fe: Frontend = request.app.state.frontend
    fe.check_model(body.model)
    fe.check_limits(body)
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    scores, tokens = await pair_scores(fe, request, [(body.query, t) for t in texts], body.truncate_prompt_tokens,
                                       "documents")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
    results = [{"index": i, "relevance_score": scores[i],
                "document": {"text": texts[i]} if body.return_documents else None} for i in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": fe.model_name, "usage": {"total_tokens": tokens},
            "results": results}


@router.post("/api/embed", response_model=OllamaEmbedResponse,
             responses=error_responses(*GENERATION_ERRORS, ollama=True))
async def ollama_embed(body: OllamaEmbedRequest, request: Request) -> dict:
    fe: Frontend = request.app.state.frontend
    start = time.monotonic_ns()
    fe.check_model(body.model)
    fe.check_limits(body)
    truncate = -1 if body.truncate else None
    params = embed_params(fe, body.dimensions, None, truncate)
    prompts = tokenize_inputs(fe, body.input, "input", truncate)
    data = await pool(fe, request, prompts, params)
    return {"model": body.model, "embeddings": [v.tolist() for v in data],
            "total_duration": time.monotonic_ns() - start, "load_duration": 0,
            "prompt_eval_count": sum(map(len, prompts))}


@router.post("/api/embeddings", response_model=OllamaEmbeddingsResponse,
             responses=error_responses(*GENERATION_ERRORS, ollama=True))
async def ollama_embeddings(body: OllamaEmbeddingsRequest, request: Request) -> dict:
    fe: Frontend = request.app.state.frontend
    fe.check_model(body.model)
    fe.check_limits(body)
    params = embed_params(fe, None, None, -1)
    prompts = tokenize_inputs(fe, body.prompt, "prompt", -1)
    (vector,) = await pool(fe, request, prompts, params)
    return {"embedding": vector.tolist()}
