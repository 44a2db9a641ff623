"""SamplingParams, with the names and meaning of vLLM's offline API."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagoda.errors import RequestError

# What torch.Generator.manual_seed and int64 tensors take; seeds outside overflowed in the sampler.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 64  # per request; the server streams with a hold-back of the longest one
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


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
        elif isinstance(self.stop, (list, tuple)) or self.stop is None:
            self.stop_strings = list(self.stop or [])
        else:
            raise RequestError(f"invalid sampling parameter stop={_short(self.stop)}: must be a string or a list "
                               f"of strings", field="stop")
        if self.top_k == -1 and not isinstance(self.top_k, bool):
            self.top_k = 0
        self.validate()

    def validate(self, max_logprobs: int | None = None, vocab_size: int | None = None,
                 max_n: int | None = None) -> None:
        """Check every field; a bad one raises RequestError naming it. The engine passes its
        limits (``max_logprobs``, the model's ``vocab_size``, ``max_n``), so a value that would
        overflow a generator or a tensor later is refused here, never inside a step."""
        def bad(name: str, why: str, code: str | None = None) -> RequestError:
            value = getattr(self, name)
            return RequestError(f"invalid sampling parameter {name}={_short(value)}: {why}", field=name, code=code)

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if max_n is not None and self.n > max_n:
            raise bad("n", f"must be at most {max_n} (the engine's max_n)")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= (vocab_size or INT64_MAX):
            limit = f"the vocabulary size ({vocab_size})" if vocab_size else "2**63 - 1"
            raise bad("top_k", f"must be -1 or 0 (off), or an integer from 1 to {limit}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None:
            if not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX:
                raise bad("seed", f"must be an integer from {INT64_MIN} to {INT64_MAX}")
            if self.seed > INT64_MAX - (self.n - 1):  # completion i of n uses seed + i (see Request)
                raise bad("seed", f"with n={self.n} must be at most {INT64_MAX - (self.n - 1)} (completion i "
                                  f"draws from seed + i)", code="invalid_combination")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be a finite number > 0")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX):
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT64_MAX:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})", code="invalid_combination")
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise bad("stop", "must be a non-empty string or a list of them")
        if len(self.stop_strings) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop_strings):
            raise bad("stop", f"takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters")
        if self.stop_token_ids is not None:
            top = vocab_size or INT64_MAX + 1
            if (not isinstance(self.stop_token_ids, (list, tuple)) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
                    or not all(_is_int(t) and 0 <= t < top for t in self.stop_token_ids)):
                raise bad("stop_token_ids", f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids in "
                                            f"[0, {top})")
        if self.logprobs is not None:
            if not _is_int(self.logprobs) or self.logprobs < 0:
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
    """A finite int or float (not a bool, not NaN or infinity: JSON's 1e999 parses as inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
