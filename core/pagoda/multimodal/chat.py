"""Image parts of chat messages (OpenAI content parts) taken out of the conversation: each part
becomes the model's placeholder text in the message's text, and the images are returned in
order with the field that names their part (``messages[0].content[1]``)."""

from __future__ import annotations

from typing import Any

from pagoda.errors import RequestError
from pagoda.multimodal.fetch import FetchPolicy, fetch_image_bytes

IMAGE_PART_TYPES = ("image_url", "image", "image_pil")


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                                          for p in m["content"]) for m in messages)


def split_image_parts(messages: list[dict], placeholder_text: str | None, policy: FetchPolicy = FetchPolicy(),
                      field: str = "messages") -> tuple[list[dict], list[tuple[Any, str]]]:
    """(messages with string contents, [(image bytes or PIL image, its field)]). ``placeholder_text``
    None: the model is text-only, and any image part is a RequestError naming it."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        texts = []
        for j, part in enumerate(content):
            where = f"{field}[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(part.get("text", ""))
                continue
            if kind not in IMAGE_PART_TYPES:
                raise RequestError(f"content part type {kind!r} is not supported (text, image_url)", field=where)
            if placeholder_text is None:
                raise RequestError("this model is text-only: it takes no images", field=where)
            value = part.get(kind)
            if kind == "image_url":
                url = value.get("url") if isinstance(value, dict) else value
                value = fetch_image_bytes(url, f"{where}.image_url.url", policy)
            images.append((value, where))
            texts.append(placeholder_text)
        out.append({**message, "content": "".join(texts)})
    return out, images
