"""Image URLs of chat content parts: ``data:`` URLs decoded in place; http(s) URLs fetched with a
size limit and a timeout (``httpx``), or refused when fetching is turned off."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from pagoda.errors import RequestError


@dataclass(frozen=True)
class FetchPolicy:
    allow_http: bool = True  # server: media_fetch
    timeout: float = 10.0  # seconds for the whole download
    max_bytes: int = 20 << 20


def data_url_bytes(url: str, field: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise RequestError("is a data URL without a ',' before its data", field=field)
    if not head.lower().startswith("data:image/"):
        raise RequestError(f"is a data URL of {head[5:] or 'no media type'!r}; an image (data:image/...) is "
                           f"expected", field=field)
    if head.endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError("is a data URL whose base64 data does not decode", field=field) from None
    return unquote_to_bytes(payload)


def fetch_image_bytes(url: str, field: str, policy: FetchPolicy = FetchPolicy()) -> bytes:
    """The bytes an image URL names; RequestError naming ``field`` for a bad or refused URL."""
    if not isinstance(url, str):
        raise RequestError("an image URL must be a string", field=field)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return data_url_bytes(url, field)
    if scheme not in ("http", "https"):
        raise RequestError(f"URL scheme {scheme or '(none)'!r} is not supported: send a data: URL or an "
                           f"http(s) URL", field=field)
    if not policy.allow_http:
        raise RequestError("this server does not fetch image URLs (media_fetch is off): send the image as a "
                           "data: URL", field=field)
    try:
        import httpx
    except ImportError:
        raise RequestError("fetching image URLs needs httpx, which is not installed here (pip install "
                           "'pagoda-core[vision]'); send a data: URL", field=field) from None
    try:
        with httpx.stream("GET", url, timeout=policy.timeout, follow_redirects=True) as response:
            if response.status_code != 200:
                raise RequestError(f"fetching the image gave HTTP {response.status_code}", field=field)
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > policy.max_bytes:
                    raise RequestError(f"the image at this URL is larger than media_max_bytes={policy.max_bytes}",
                                       field=field)
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as exc:
        raise RequestError(f"the image could not be fetched: {type(exc).__name__}: {exc}", field=field) from None
