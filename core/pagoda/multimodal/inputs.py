"""A request's images as placed in its prompt: where each image's tokens are, its processed
pixels, its content hash (prefix-cache keys), and the prompt's M-RoPE positions. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(eq=False)
class PlacedImage:
    offset: int  # index of its first token in the prompt
    num_tokens: int
    hash: bytes  # pagoda.multimodal.media.image_hash
    image: Any  # pagoda.interfaces.ImageInput (pixels and grid for the encoder)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    def hash_key(self) -> tuple[int, ...]:
        """The hash as prefix-cache key material: a marker that no token id is, then 2 signed int64s."""
        lo, hi = int.from_bytes(self.hash[:8], "little", signed=True), int.from_bytes(self.hash[8:], "little",
                                                                                     signed=True)
        return (-1, lo, hi)


@dataclass(eq=False)
class MultiModalInputs:
    prompt_token_ids: list[int]  # with every placeholder expanded
    images: list[PlacedImage]
    positions: np.ndarray | None = None  # int64 [3, len(prompt)] (M-RoPE) or None (1-D positions)
    position_delta: int = 0  # a token after the prompt at index p has position p + delta
    _extra: dict = field(default_factory=dict)

    def block_extra(self, start: int, end: int) -> tuple[int, ...]:
        """Prefix-cache key material of tokens [start, end): the hashes of the images they overlap,
        so two different images never share cached blocks and the same image does."""
        key = (start, end)
        found = self._extra.get(key)
        if found is None:
            found = tuple(v for im in self.images if im.offset < end and im.end > start for v in im.hash_key())
            self._extra[key] = found
        return found

    def positions_for(self, start: int, end: int) -> np.ndarray:
        """int64 [3, end - start] positions of tokens [start, end) (prompt or generated)."""
        n_prompt = len(self.prompt_token_ids)
        out = np.empty((3, end - start), np.int64)
        k = max(0, min(end, n_prompt) - start)
        if k:
            out[:, :k] = self.positions[:, start:start + k]
        if end - start > k:
            out[:, k:] = np.arange(start + k, end) + self.position_delta
        return out
