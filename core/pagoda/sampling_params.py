"""SamplingParams, with the names and meaning of vLLM's offline API."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from pagoda.errors import RequestError
from pagoda.structured_outputs.params import StructuredOutputsParams

# What torch.Generator.manual_seed and int64 tensors take; seeds outside overflowed in the sampler.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 64  # per request; the server streams with a hold-back of the longest one
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # logit_bias entries


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
    prompt_logprobs: int | None = None  # logprobs of each prompt token (and the top k), from the prefill
    skip_special_tokens: bool = True
    detokenize: bool = True
    # what the request does to its own logits (pagoda.logits_processors), and its grammar
    logit_bias: dict[int, float] | None = None  # token id -> bias, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be generated
    bad_words: list[str] | None = None  # words that must not be generated
    logits_processors: list[str] | None = None  # names of logits processors the engine enabled
    structured_outputs: StructuredOutputsParams | None = None  # the output must match a grammar
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens (-1: max_model_len of them)
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
        if self.truncate_prompt_tokens is not None and (
                not _is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens == 0
                or not -1 <= self.truncate_prompt_tokens <= INT64_MAX):
            raise bad("truncate_prompt_tokens", "must be -1 (as many as the context holds) or an integer >= 1")
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                if not _is_int(value) or value < 0:
                    raise bad(name, "must be an integer >= 0")
                if max_logprobs is not None and value > max_logprobs:
                    raise bad(name, f"must be at most {max_logprobs} (the engine's max_logprobs)")
        top = vocab_size or INT64_MAX + 1
        if self.logit_bias is not None:
            if (not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS
                    or not all(_is_int(t) and t >= 0 and _is_number(b) for t, b in self.logit_bias.items())):
                raise bad("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids to finite numbers")
            if any(t >= top for t in self.logit_bias):
                raise bad("logit_bias", f"holds a token id outside the vocabulary [0, {top})",
                          code="token_out_of_vocabulary")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                or not all(_is_int(t) and 0 <= t < top for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", f"must be a non-empty list of token ids in [0, {top})")
        if self.bad_words is not None and (
                not isinstance(self.bad_words, (list, tuple)) or len(self.bad_words) > MAX_STOP_STRINGS
                or not all(isinstance(w, str) and w.strip() and len(w) <= MAX_STOP_CHARS for w in self.bad_words)):
            raise bad("bad_words", f"must be at most {MAX_STOP_STRINGS} non-blank strings of at most "
                                   f"{MAX_STOP_CHARS} characters")
        if self.logits_processors is not None and (
                not isinstance(self.logits_processors, (list, tuple))
                or not all(isinstance(n, str) for n in self.logits_processors)):
            raise bad("logits_processors", "must be a list of names")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        cached = self.__dict__
        for key in _DERIVED:  # assigning any field clears the flags derived from them
            cached.pop(key, None)

    @functools.cached_property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)

    @functools.cached_property
    def needs_processing(self) -> bool:
        """Whether the request changes its own logits before a token is chosen (see
        pagoda.logits_processors; its grammar is applied apart)."""
        return bool(self.needs_penalties or self.logit_bias or self.allowed_token_ids or self.bad_words
                    or self.min_tokens or self.logits_processors)

    @functools.cached_property
    def argmax_only(self) -> bool:
        """Greedy, nothing done to the logits, no logprobs, no grammar: the token is the argmax of
        the logits, so it can stay on the device (steps launched ahead of the host)."""
        return (self.greedy and not self.needs_processing and self.logprobs is None
                and self.prompt_logprobs is None and self.structured_outputs is None)

    @functools.cached_property
    def samples_on_device(self) -> bool:
        """Nothing but a grammar mask (filled from matchers the host advances) comes between the logits
        and the token: greedy or random selection, no logits processing, no logprobs. Such rows are
        chosen on the device (``Sampler.select_on_device``) in steps launched ahead of the host."""
        return not self.needs_processing and self.logprobs is None and self.prompt_logprobs is None


# Flags the engine reads for every row of every step (a chain of properties took 0.2-0.6 us each time):
# computed once per SamplingParams, until a field is assigned (a list field changed in place is not seen).
_DERIVED = ("needs_penalties", "needs_processing", "argmax_only", "samples_on_device")


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool, not NaN or infinity: JSON's 1e999 parses as inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
