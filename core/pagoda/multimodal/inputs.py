"""A request's images as placed in its prompt: where each image's tokens are, its processed
pixels, its content hash (prefix-cache keys), and the prompt's M-RoPE positions; how they cross to
another process (``for_transfer`` / ``arrived``). No torch but in ``arrived``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
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


def block_key_images(inputs: MultiModalInputs | None, block: int) -> tuple[int, ...]:
    """Key material of the images in a prompt's first ``block`` tokens (none without images)."""
    return inputs.block_extra(0, block) if inputs is not None else ()


def for_transfer(inputs: MultiModalInputs) -> MultiModalInputs:
    """A copy whose images' pixels are numpy arrays, to send to another process: multiprocessing pickles a
    CPU tensor as a shared-memory handle that a process it did not start cannot open."""
    return replace(inputs, images=[replace(p, image=replace(p.image, pixel_values=p.image.pixel_values.numpy()))
                                   for p in inputs.images], _extra={})


def arrived(inputs: MultiModalInputs) -> MultiModalInputs:
    """``for_transfer``'s inverse, in the receiving process: the pixels as tensors again."""
    import torch

    for placed in inputs.images:
        placed.image = replace(placed.image, pixel_values=torch.from_numpy(placed.image.pixel_values))
    return inputs
