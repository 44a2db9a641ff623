"""The offline pooling API behind ``LLM.encode/embed/classify/score`` (vLLM's names and outputs)."""

from __future__ import annotations

from dataclasses import replace

import torch

from pagoda.errors import RequestError
from pagoda.pooling.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagoda.pooling.params import PoolingParams


def as_prompt_list(prompts) -> list:
    """One prompt (text or token ids) or a list of them -> a list."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def pair_token_ids(tokenizer, text_1: str, text_2: str) -> list[int]:
    """A cross-encoder's input: the tokenizer's pair encoding (its special tokens between and around)."""
    if tokenizer is None:
        raise RequestError("scoring text pairs needs the model's tokenizer", field="text_1")
    return list(tokenizer(text_1, text_2)["input_ids"])


def pair_up(text_1, text_2) -> list[tuple]:
    """vLLM's pairing: 1 x N (the one paired with each), or N x N (zipped)."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} items and text_2 {len(second)}: give one text_1, or as many "
                         f"as text_2")
    return list(zip(first, second))


def encode(llm, prompts, params: PoolingParams | list[PoolingParams]) -> list[PoolingRequestOutput]:
    prompts = as_prompt_list(prompts)
    params = params if isinstance(params, list) else [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} pooling_params for {len(prompts)} prompts")
    engine = llm.engine
    if engine.pooling is None:
        raise RequestError("LLM(..., runner='pooling') computes embeddings and scores; this LLM generates text",
                           field="runner", code="unsupported_task")
    outputs = llm.run_requests(((prompt, p, {}) for prompt, p in zip(prompts, params)), prefix="pool")
    failed = next((o for o in outputs if o.error), None)
    if failed is not None:
        raise RuntimeError(f"request {failed.request_id} failed: {failed.error}")
    return outputs


def embed(llm, prompts, params: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
    params = replace(params or PoolingParams(), task="embed")
    return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data.tolist()), o.prompt_token_ids)
            for o in encode(llm, prompts, params)]


def classify(llm, prompts, params: PoolingParams | None = None) -> list[ClassificationRequestOutput]:
    params = replace(params or PoolingParams(), task="classify")
    return [ClassificationRequestOutput(o.request_id, ClassificationOutput(o.outputs.data.tolist()),
                                        o.prompt_token_ids) for o in encode(llm, prompts, params)]


def score(llm, text_1, text_2, params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
    """A score per (text_1, text_2) pair: the score head on the pair's encoding (cross-encoders and
    rerankers), or the cosine similarity of the two embeddings (embedding models)."""
    pairs = pair_up(text_1, text_2)
    pooling = llm.engine.pooling
    if pooling is not None and pooling.head is not None:
        if pooling.head.num_labels != 1:
            raise RequestError(f"scores need a model with one label; this one has {pooling.head.num_labels} "
                               f"(use LLM.classify)", field="task", code="unsupported_task")
        params = replace(params or PoolingParams(), task="score")
        prompts = [pair_token_ids(llm.tokenizer, a, b) for a, b in pairs]
        outs = encode(llm, prompts, params)
        return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids)
                for o in outs]
    firsts = embed(llm, [a for a, _ in pairs], params)
    seconds = embed(llm, [b for _, b in pairs], params)
    found = []
    for a, b in zip(firsts, seconds):
        cosine = torch.nn.functional.cosine_similarity(torch.tensor(a.outputs.embedding),
                                                       torch.tensor(b.outputs.embedding), dim=0)
        found.append(ScoringRequestOutput(f"score-{a.request_id}", ScoringOutput(float(cosine)),
                                          a.prompt_token_ids + b.prompt_token_ids))
    return found
