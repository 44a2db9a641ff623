"""PoolingParams: what one pooling request asks for (vLLM's names). No torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagoda.errors import RequestError

TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    """``task``: embed (a vector), classify (class probabilities from the score head), score (one
    relevance number from the score head). ``dimensions``: keep the first N of an embedding
    (Matryoshka), before normalizing. ``normalize``: None takes the engine's. ``activation``:
    softmax/sigmoid on scores (default on). ``truncate_prompt_tokens``: keep the last N prompt tokens
    (-1: as many as the context holds) instead of refusing a prompt over the context."""

    task: Literal["embed", "classify", "score"] = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool = True
    truncate_prompt_tokens: int | None = None

    def validate(self) -> None:
        if self.task not in TASKS:
            raise RequestError(f"task {self.task!r} is not one of {', '.join(TASKS)}", field="task")
        if self.dimensions is not None and (type(self.dimensions) is not int or self.dimensions < 1):
            raise RequestError(f"dimensions must be an integer >= 1 (got {self.dimensions!r})", field="dimensions")
        if self.truncate_prompt_tokens is not None and (type(self.truncate_prompt_tokens) is not int or
                                                        self.truncate_prompt_tokens < -1 or
                                                        self.truncate_prompt_tokens == 0):
            raise RequestError(f"truncate_prompt_tokens must be -1 or an integer >= 1 (got "
                               f"{self.truncate_prompt_tokens!r})", field="truncate_prompt_tokens")
