"""A request's prompt as token ids, checked where every engine front takes one (``LLMEngine``, the
pooling runner, the data-parallel front): the same refusals, naming the ``prompt`` field."""

from __future__ import annotations

from collections.abc import Callable

from pagoda.errors import RequestError


def prompt_token_ids(prompt, token_ids: list[int] | None, tokenize: Callable[[str], list[int]]) -> list[int]:
    """``token_ids`` when given, else ``prompt`` tokenized (text) or copied (a list of ids)."""
    if token_ids is not None:
        return list(token_ids)
    if isinstance(prompt, str):
        return tokenize(prompt)
    if isinstance(prompt, (list, tuple)):
        return list(prompt)
    raise RequestError("a prompt (text or token ids) is required", field="prompt")


def check_prompt_ids(token_ids: list[int], vocab_size: int) -> None:
    """Refuse an empty prompt and ids outside the vocabulary (bools are not token ids)."""
    if not token_ids:
        raise RequestError("the prompt is empty", field="prompt")
    if not all(type(t) is int and 0 <= t < vocab_size for t in token_ids):
        raise RequestError(f"prompt token ids must be integers in [0, {vocab_size})", field="prompt")


def truncate_prompt_ids(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """``truncate_prompt_tokens`` (as vLLM): the prompt's last ``keep`` tokens, -1 meaning as many as
    the context holds (max_model_len); None keeps the prompt whole. Over max_model_len is refused."""
    if keep is None:
        return token_ids
    n = max_model_len if keep == -1 else keep
    if n > max_model_len:
        raise RequestError(f"truncate_prompt_tokens={keep} is over this model's max_model_len {max_model_len}",
                           field="truncate_prompt_tokens")
    return token_ids[-n:]
