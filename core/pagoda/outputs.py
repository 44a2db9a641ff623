"""What generation returns, with the names of vLLM's offline API."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


class ListView(Sequence):
    """``items[start:stop]`` of a list that is only ever appended to past ``stop``, without a copy: what an
    unfinished output holds (the sequence's tokens and logprobs in the engine; at the front of an engine in
    another process, one list per completion that each step's delta extends). Indexes, slices and iterates as
    a list does, compares equal to a list of the same items, and pickles as a list."""

    __slots__ = ("items", "start", "stop")

    def __init__(self, items: list, start: int, stop: int):
        self.items, self.start, self.stop = items, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i):
        n = self.stop - self.start
        if isinstance(i, slice):
            first, last, step = i.indices(n)
            if step == 1:
                return self.items[self.start + first:self.start + max(first, last)]
            return [self.items[self.start + k] for k in range(first, last, step)]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("list index out of range")
        return self.items[self.start + i]

    def __iter__(self):
        return itertools.islice(self.items, self.start, self.stop)

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, ListView)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None

    def __add__(self, other) -> list:
        return list(self) + list(other)

    def __radd__(self, other) -> list:
        return list(other) + list(self)

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self):
        return list, (list(self),)


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions; text and token_ids are cumulative. A finished output holds lists;
    an unfinished one (streamed: ``LLMEngine.step()``, the server) holds ``ListView``s, read-only windows of
    the engine's own lists that index, slice, iterate, compare and pickle as lists do, so that a stream
    costs no copy of all its tokens per step; ``list(...)`` gives a list."""

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
