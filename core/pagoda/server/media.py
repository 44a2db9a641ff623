"""Images of server requests: chat ``image_url`` content parts and Ollama ``images`` taken out of
the conversation, fetched and processed in worker threads (never on the event loop or the
engine loop). A bad image is a 400 that names its content part."""

from __future__ import annotations

import asyncio
from typing import Any

from pagoda.errors import RequestError
from pagoda.multimodal.chat import has_images, split_image_parts
from pagoda.multimodal.fetch import FetchPolicy


def _named(exc: RequestError, rename=None) -> RequestError:
    """The error with its field (``rename``d: Ollama's ``images``) in the message and the documented
    code ``invalid_image`` (``pagoda.server.openapi.SEMANTIC_400_CODES``)."""
    field = rename(exc.field) if rename is not None and exc.field else exc.field
    text = str(exc)
    if field and not text.startswith(field):
        text = f"{field}: {text}"
    return RequestError(text, field=field, code=exc.code or "invalid_image")


def ollama_field(prefix: str | None = None):
    """``messages[i].content[k]`` -> ``messages[i].images[k]`` (the images come first in the parts), or
    ``{prefix}[k]`` for /api/generate's top-level ``images``."""
    def rename(field: str) -> str:
        head, sep, tail = field.partition(".content[")
        if not sep:
            return field
        return f"{prefix}[{tail}" if prefix else f"{head}.images[{tail}"
    return rename


def fetch_policy(config) -> FetchPolicy:
    return FetchPolicy(allow_http=config.media_fetch, timeout=config.media_fetch_timeout,
                       max_bytes=config.media_max_bytes)


async def take_images(fe, messages: list[dict], rename=None) -> tuple[list[dict], list[tuple[Any, str]]]:
    """(messages with the model's placeholder text where their images were, [(image, field)])."""
    if not has_images(messages):
        return messages, []
    proc = fe.async_engine.engine.mm_processor
    try:
        return await asyncio.to_thread(split_image_parts, messages, proc.placeholder_text if proc else None,
                                       fetch_policy(fe.config))
    except RequestError as exc:
        raise _named(exc, rename) from None


async def process_images(fe, ids: list[int], images: list[tuple[Any, str]], prompt_param: str):
    """``pagoda.multimodal.MultiModalInputs`` of a prompt's images (None: no images)."""
    if not images:
        return None
    try:
        return await asyncio.to_thread(fe.async_engine.engine.process_multimodal, ids, images, prompt_param)
    except RequestError as exc:
        raise _named(exc) from None


def ollama_image_parts(images: list[str] | None, text: str) -> str | list[dict]:
    """An Ollama message's content with its base64 ``images`` as image parts before its text."""
    if not images:
        return text
    return [*({"type": "image", "image": image} for image in images), {"type": "text", "text": text}]
