"""Loading the tokenizer of a model source (HF directory or GGUF metadata)."""

from __future__ import annotations

import logging

from pagoda.errors import ModelLoadError
from pagoda.loader.source import ModelSource

logger = logging.getLogger("pagoda")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(source: ModelSource, tokenizer_path: str | None = None):
    if tokenizer_path is not None:
        path = tokenizer_path
    elif source.kind == "gguf":
        from pagoda.loader.gguf_file import open_gguf

        return open_gguf(source.path).tokenizer()
    else:
        path = str(source.path)
        if not any((source.path / f).is_file() for f in TOKENIZER_FILES):
            logger.warning("%s has no tokenizer files: prompts must be token ids", path)
            return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"no usable tokenizer in {path}: {exc} (pass --tokenizer DIR, or "
                             f"skip_tokenizer_init to work with token ids)") from exc


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError("this model has no chat template (tokenizer_config.json chat_template or "
                             "GGUF tokenizer.chat_template)")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
