"""A GGUF file's tokenizer on the ``tokenizers`` library alone (no transformers import).

transformers' ``PreTrainedTokenizerFast`` cost seconds and about 200 MB at start-up (its import), for
the handful of calls the engine makes. ``GGUFTokenizer`` answers those itself from the Rust tokenizer
(``backend_tokenizer``): ``encode``, ``decode``, ``convert_ids_to_tokens``, the special token ids and
the chat template (rendered with jinja2 as transformers renders it). Any other attribute builds the
transformers tokenizer once (``hf``) and is answered by it, so callers written for transformers keep
working.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


class GGUFTokenizer:
    def __init__(self, backend, tokens: list[str], special: dict[str, int | None], chat_template: str | None,
                 build_hf: Callable[[], Any]):
        self.backend_tokenizer = backend
        self._tokens = tokens
        self._special = special  # "bos"/"eos"/"unk"/"pad" -> id
        self.chat_template = chat_template
        self._build_hf = build_hf
        self._hf = None

    # ---------------------------------------------------------------- the engine's calls
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = False, **_: Any) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def _token(self, key: str) -> str | None:
        idx = self._special.get(key)
        return self._tokens[idx] if idx is not None else None

    @property
    def eos_token_id(self) -> int | None:
        return self._special.get("eos")

    @property
    def bos_token_id(self) -> int | None:
        return self._special.get("bos")

    @property
    def pad_token_id(self) -> int | None:
        return self._special.get("pad")

    @property
    def eos_token(self) -> str | None:
        return self._token("eos")

    @property
    def bos_token(self) -> str | None:
        return self._token("bos")

    def apply_chat_template(self, messages: list[dict], tokenize: bool = True, add_generation_prompt: bool = False,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            **kwargs: Any):
        """The chat template (the file's, or ``chat_template``) rendered as transformers renders it (a
        sandboxed jinja2 environment with trim_blocks and lstrip_blocks, ``raise_exception``,
        ``tojson``, ``strftime_now``; ``continue_final_message`` ends the text at the last message's
        content, for the model to go on with it)."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template")
        text = _template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        if continue_final_message:
            final = messages[-1].get("content")
            final = final if isinstance(final, str) else ""
            at = text.rfind(final.strip()) if final.strip() else -1
            if at < 0:
                raise ValueError("continue_final_message: the final message's content is not in the rendered text")
            text = text[:at + len(final.strip())]
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # ---------------------------------------------------------------- everything else: transformers
    @property
    def hf(self):
        """The transformers tokenizer of the same vocabulary (built on first use)."""
        if self._hf is None:
            self._hf = self._build_hf()
        return self._hf

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf, name)


@functools.lru_cache(maxsize=8)
def _template(source: str):
    from datetime import datetime

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        import json

        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
