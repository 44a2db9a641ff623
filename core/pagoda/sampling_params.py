"""SamplingParams, with the names and meaning of vLLM's offline API."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.errors import RequestError


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    temperature 0 is greedy. ``logprobs=k`` returns the sampled token's log-probability
    and the top k (from the model's raw distribution, before temperature and penalties).
    ``stop`` strings are removed from the output text unless ``include_stop_str_in_output``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self, max_logprobs: int | None = None) -> None:
        def bad(name: str, why: str) -> RequestError:
            value = getattr(self, name)
            return RequestError(f"invalid sampling parameter {name}={value!r}: {why}", field=name)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 or -1 turns it off)")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise bad("stop", "must be a non-empty string or a list of them")
        if self.stop_token_ids is not None and not all(
                isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids >= 0")
        if self.logprobs is not None:
            if not isinstance(self.logprobs, int) or self.logprobs < 0:
                raise bad("logprobs", "must be an integer >= 0")
            if max_logprobs is not None and self.logprobs > max_logprobs:
                raise bad("logprobs", f"must be at most {max_logprobs} (the engine's max_logprobs)")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)

    @property
    def argmax_only(self) -> bool:
        """Greedy without penalties or logprobs: the token is the argmax of the logits, so it can
        stay on the device (steps launched ahead of the host)."""
        return self.greedy and not self.needs_penalties and self.logprobs is None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
