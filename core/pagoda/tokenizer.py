"""Loading the tokenizer of a model source (HF directory or GGUF metadata)."""

from __future__ import annotations

import logging

from pagoda.errors import ModelLoadError
from pagoda.loader.source import ModelSource

logger = logging.getLogger("pagoda")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def tokenizer_location(tokenizer: str | None, source: ModelSource, revision: str | None = None,
                       download_dir: str | None = None) -> str | None:
    """The local folder of ``tokenizer`` (a directory or a hub repo id, fetched at ``revision``); None:
    the model's own. A hub model with a ``tokenizer_revision`` takes its tokenizer from that revision."""
    from pathlib import Path

    from pagoda.loader.hub import download, parse_hub_reference

    if tokenizer is None and revision is not None and source.repo_id is not None:
        tokenizer = source.repo_id
    if tokenizer is None or Path(tokenizer).expanduser().exists():
        return tokenizer
    ref = parse_hub_reference(tokenizer)
    if ref is None or ref.gguf:
        raise ModelLoadError(f"tokenizer {tokenizer!r} does not exist: give a tokenizer directory or a Hugging Face "
                             f"Hub repo id ORG/NAME")
    return str(download(ref, revision, download_dir, tokenizer_only=True))


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


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        tools: list[dict] | None = None, chat_template: str | None = None,
                        continue_final_message: bool = False, **kwargs) -> str:
    """The prompt text of a conversation through the model's chat template (or ``chat_template``,
    a Jinja template that replaces it). ``tools`` (OpenAI's function definitions) and ``kwargs``
    (``chat_template_kwargs``, e.g. ``enable_thinking=False``) reach the template as variables."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if tokenizer is None or not template:
        raise ModelLoadError("this model has no chat template (tokenizer_config.json chat_template or "
                             "GGUF tokenizer.chat_template); give one with --chat-template")
    if continue_final_message:
        add_generation_prompt = False
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         tools=tools or None, chat_template=template,
                                         continue_final_message=continue_final_message, **kwargs)
