"""What pooling returns, with the names of vLLM's offline API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.outputs import RequestMetrics


@dataclass
class PoolingOutput:
    data: Any  # torch.Tensor on the CPU, float32: [dim] (embed), [num_labels] (classify/score)


@dataclass
class PoolingRequestOutput:
    """One finished pooling request, as ``LLMEngine.step`` returns it (always ``finished``)."""

    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool = True
    metrics: RequestMetrics | None = None
    error: str | None = None  # the request failed inside a step; the others went on
    prompt: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int] = field(default_factory=list)
    finished: bool = True
