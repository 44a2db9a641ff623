"""The runner's encoder step: run the vision tower for the images a step reaches (all new images
of the step in one batch), keep the outputs in an encoder cache keyed by image content, and give
the model the image rows and 3-D positions of the step.

A chunked prefill may cut through an image: the image is encoded once, when its first tokens are
scheduled, and later chunks take their rows from the cache. Entries stay while a live sequence
uses them (a preempted sequence recomputes without re-encoding) and then wait in a small LRU of
spare entries, so a repeated image is not encoded again soon after.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from pagoda.kernels.host_upload import upload

SPARE_ENTRIES = 32  # encoder outputs no live sequence uses, kept for images sent again


class EncoderCache:
    def __init__(self, spare: int = SPARE_ENTRIES):
        self.entries: dict[bytes, torch.Tensor] = {}
        self.users: dict[bytes, set[int]] = {}
        self.seq_images: dict[int, set[bytes]] = {}
        self.spare: OrderedDict[bytes, None] = OrderedDict()
        self.max_spare = spare
        self.num_encoded = 0  # images run through the encoder (stats, tests)

    def get(self, key: bytes, seq_id: int) -> torch.Tensor | None:
        found = self.entries.get(key)
        if found is not None:
            self._use(key, seq_id)
        return found

    def put(self, key: bytes, embeds: torch.Tensor, seq_id: int) -> None:
        self.entries[key] = embeds
        self.num_encoded += 1
        self._use(key, seq_id)

    def _use(self, key: bytes, seq_id: int) -> None:
        self.spare.pop(key, None)
        self.users.setdefault(key, set()).add(seq_id)
        self.seq_images.setdefault(seq_id, set()).add(key)

    def forget(self, seq_id: int) -> None:
        for key in self.seq_images.pop(seq_id, ()):
            users = self.users.get(key)
            users.discard(seq_id)
            if not users:
                del self.users[key]
                self.spare[key] = None
        while len(self.spare) > self.max_spare:
            key, _ = self.spare.popitem(last=False)
            self.entries.pop(key, None)


class MultiModalStep:
    def __init__(self, model, device: torch.device):
        self.model = model
        self.device = device
        self.cache = EncoderCache()

    def prepare(self, plan, inputs) -> None:
        """Set ``inputs.positions`` to [3, T] when a sequence of the step has 3-D positions and
        ``inputs.model_kwargs["image_embeds"]`` when the step computes image tokens (the images: the plan's
        ``mm_inputs``)."""
        if not plan.mm_inputs:  # (no row's prompt has images)
            return
        qsl = inputs.meta.query_start_loc_cpu
        spans = []  # (its sequence's images, row of its first token, first token index, count, seq_id)
        for i, (r, mm) in enumerate(zip(plan.rows, plan.mm_inputs)):
            spans.append((mm, qsl[i], r.num_computed_tokens, r.num_new_tokens, r.seq_id))
        if any(mm is not None and mm.positions is not None for mm, *_ in spans):
            positions = np.empty((3, qsl[-1]), np.int64)
            for mm, row, start, k, _ in spans:
                positions[:, row:row + k] = np.arange(start, start + k) if mm is None or mm.positions is None \
                    else mm.positions_for(start, start + k)
            inputs.positions = upload(positions, self.device)
        wanted = []  # (seq_id, image, row in step, first row of the image's embeddings, count)
        for mm, row, start, k, seq_id in spans:
            if mm is None or start >= len(mm.prompt_token_ids):
                continue
            for im in mm.images:
                lo, hi = max(im.offset, start), min(im.end, start + k)
                if lo < hi:
                    wanted.append((seq_id, im, row + lo - start, lo - im.offset, hi - lo))
        if not wanted:
            return
        self._encode_missing(wanted)
        rows, embeds = [], []
        for _, im, row, first, count in wanted:
            rows.append(np.arange(row, row + count))
            embeds.append(self.cache.entries[im.hash][first:first + count])
        inputs.model_kwargs["image_embeds"] = (upload(np.concatenate(rows), self.device), torch.cat(embeds))

    def _encode_missing(self, wanted) -> None:
        new, seqs = {}, {}
        for seq_id, im, *_ in wanted:
            if self.cache.get(im.hash, seq_id) is None:
                new.setdefault(im.hash, im.image)
                seqs.setdefault(im.hash, []).append(seq_id)
        if not new:
            return
        outputs = self.model.encode_images(list(new.values()))
        for (key, _), embeds in zip(new.items(), outputs):
            for i, seq_id in enumerate(seqs[key]):
                if i == 0:
                    self.cache.put(key, embeds, seq_id)
                else:
                    self.cache._use(key, seq_id)

    def forget(self, seq_id: int) -> None:
        self.cache.forget(seq_id)
