"""Sequences (one completion) and requests (a prompt with its ``n`` sequences). No torch."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from pagoda.outputs import Logprob, RequestMetrics
from pagoda.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the request failed inside a step (see LLMEngine.fail_request)

    @property
    def finished(self) -> bool:
        # (by value in a set: 7x faster than comparing with the members, and the host asks per sequence and step)
        return self._value_ in _FINISHED_VALUES


_FINISHED_VALUES = frozenset(m.value for m in SequenceStatus if m.name.startswith("FINISHED_"))


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One token stream. ``token_ids`` is prompt + output; the first ``num_computed_tokens``
    of it have their K/V in the cache blocks listed in ``block_table``."""

    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # block tables of KV cache groups 1.. (models mixing sliding-window and global layers; see
    # pagoda.engine.block_manager); entries of blocks that left a window are NULL_BLOCK (-1)
    group_block_tables: list[list[int]] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of its full, cached blocks
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # detokenization state (pagoda.engine.detokenizer)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    decode_stream: list | bool | None = None  # [its DecodeStream, tokens given to it]; False: windows only
    tokens: list[str] | None = None
    # sampling results
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    output_counts: dict[int, int] | None = None  # generated token -> count, for penalties
    # per-request logits work that needs state (pagoda.logits_processors, pagoda.structured_outputs)
    bad_words_ids: list[list[int]] | None = None  # token sequences of the request's bad_words
    grammar: object | None = None  # its structured-output grammar matcher, while it constrains the output
    # (matcher, reasoning parser, where the output starts): a grammar waiting for the reasoning to end
    pending_grammar: tuple | None = None
    # a token the first output token may be besides the grammar's (the one opening the reasoning)
    grammar_opening: tuple | None = None  # (token id, reasoning parser, where the output starts)
    # the runner computes the logprob of each prompt token when this sequence prefills (prompt_logprobs:
    # the first sequence of a request that asks; sent to tensor-parallel ranks in the step plan)
    wants_prompt_logprobs: bool = False
    # the request's images placed in its prompt (pagoda.multimodal.MultiModalInputs), shared by siblings
    mm_inputs: object | None = None
    # the LoRA adapter it runs with (pagoda.lora.LoRARequest), None for the base model
    lora_request: object | None = None

    @property
    def lora_int_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self._count(token_id)

    def fill_last_token(self, token_id: int) -> None:
        """Write a sampled token over the placeholder that ``Scheduler.advance`` appended."""
        self.token_ids[-1] = token_id
        self._count(token_id)

    def _count(self, token_id: int) -> None:
        if self.output_counts is not None:
            self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1

    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None


@dataclass(eq=False)
class Request:
    """A prompt and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the request failed inside a step (its sequences end with "error")
    # prompt_logprobs: per prompt position, None (the first) or {token id: Logprob}, filled as prefill runs
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if not self.seqs:
            for i in range(self.params.n):
                seed = None if self.params.seed is None else self.params.seed + i
                seq = Sequence(self.request_id, i, self.prompt_token_ids, self.params, seed=seed)
                if self.params.needs_penalties:
                    seq.output_counts = {}
                if self.params.logprobs is not None:
                    seq.logprobs = []
                seq.wants_prompt_logprobs = i == 0 and self.params.prompt_logprobs is not None
                self.seqs.append(seq)
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
