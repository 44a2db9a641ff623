"""What generation returns, with the names of vLLM's offline API."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions; text and token_ids are cumulative. A final output holds lists;
    a streamed one from an engine in another process (``pagoda serve``'s default, ``data_parallel_size`` > 1)
    may hold read-only sequences that index, slice, iterate and compare as lists do
    (``pagoda.distributed.output_deltas.ListPrefix``: no copy per step); ``list(...)`` gives a list."""

    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: float | None = None
    # per generated token: {token_id: Logprob} holding the sampled token and the top-k
    logprobs: Sequence[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error" (see RequestOutput.error)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    # set when the request failed inside a step (its row could not be sampled or detokenized): the
    # other requests of that step went on; this one ended with finish_reason "error"
    error: str | None = None
    # with SamplingParams.prompt_logprobs: per prompt token, None (the first) or {token id: Logprob}
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
