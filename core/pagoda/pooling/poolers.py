"""Poolers: one vector per prompt from its hidden states, computed chunk by chunk.

A prompt may be prefilled over several steps (chunked prefill), so each pooler keeps a small state
per sequence that the chunks update: LAST keeps the hidden state of the prompt's last token, MEAN a
float32 running sum (divided by the prompt length at the end), CLS the first token's. A registry by
name (``POOLERS``) so that a new pooling is one class.
"""

from __future__ import annotations

import torch


class Pooler:
    """``update(state, hidden, start, num_prompt)``: ``hidden`` [n, H] are the hidden states of prompt
    positions start .. start + n - 1; returns the new state. ``finish(state, num_prompt)`` -> [H] float32."""

    name = ""
    needs_every_token = False  # every position must be computed (no prefix-cache reuse)

    def update(self, state, hidden: torch.Tensor, start: int, num_prompt: int):
        raise NotImplementedError

    def finish(self, state, num_prompt: int) -> torch.Tensor:
        return state.float()


class LastPooler(Pooler):
    name = "LAST"

    def update(self, state, hidden, start, num_prompt):
        return hidden[-1] if start + hidden.shape[0] >= num_prompt else state


class MeanPooler(Pooler):
    name = "MEAN"
    needs_every_token = True

    def update(self, state, hidden, start, num_prompt):
        chunk = hidden.sum(dim=0, dtype=torch.float32)
        return chunk if state is None else state.add_(chunk)

    def finish(self, state, num_prompt):
        return state / num_prompt


class ClsPooler(Pooler):
    name = "CLS"
    needs_every_token = True  # the first position must be computed, never read from the prefix cache

    def update(self, state, hidden, start, num_prompt):
        return hidden[0] if start == 0 else state


POOLERS: dict[str, type[Pooler]] = {cls.name: cls for cls in (LastPooler, MeanPooler, ClsPooler)}


def get_pooler(name: str) -> Pooler:
    try:
        return POOLERS[name.upper()]()
    except KeyError:
        from pagoda.errors import ConfigError

        raise ConfigError(f"pooling_type {name!r} is not one of {', '.join(POOLERS)}") from None
