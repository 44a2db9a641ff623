"""Decoding images (PIL) from what users send, and the content hash that identifies an image
in the prefix cache and the encoder cache."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from typing import Any

from pagoda.errors import ConfigError, RequestError


def require_pillow() -> None:
    """Images are decoded with Pillow, an optional dependency."""
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise ConfigError("images need Pillow, which is not installed: pip install 'pagoda-core[vision]'") from None


def open_image(data: Any, field: str, max_pixels: int | None = None):
    """A PIL image (RGB) from a PIL image, bytes, or base64 text; a RequestError naming ``field`` when
    it is not a decodable image or has more than ``max_pixels`` pixels."""
    require_pillow()
    from PIL import Image

    if isinstance(data, Image.Image):
        image = data
    else:
        if isinstance(data, str):
            try:
                data = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise RequestError("is not valid base64 image data", field=field) from None
        if not isinstance(data, (bytes, bytearray)):
            raise RequestError(f"an image must be a PIL.Image, bytes or base64 text, not {type(data).__name__}",
                               field=field)
        try:
            image = Image.open(io.BytesIO(data))
            w, h = image.size
            if max_pixels is not None and w * h > max_pixels:
                raise RequestError(f"the image has {w}x{h} = {w * h} pixels, more than max_image_pixels="
                                   f"{max_pixels}", field=field)
            image.load()
        except RequestError:
            raise
        except Exception as exc:  # PIL raises many kinds for a corrupt or unknown file
            raise RequestError(f"is not a readable image ({type(exc).__name__}: {exc})", field=field) from None
    w, h = image.size
    if max_pixels is not None and w * h > max_pixels:
        raise RequestError(f"the image has {w}x{h} = {w * h} pixels, more than max_image_pixels={max_pixels}",
                           field=field)
    return image if image.mode == "RGB" else image.convert("RGB")


def image_hash(image) -> bytes:
    """16-byte BLAKE2b of the decoded pixels (mode, size, bytes): the same picture sent as PNG or
    as a PIL image is the same image; any changed pixel is another."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.digest()
