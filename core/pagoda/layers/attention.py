"""The attention layer models use: it reads the step's metadata and the selected backend
from the forward context and its own KV cache tensor (bound by the runner)."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.forward_context import get_forward_context
from pagoda.interfaces import AttentionSpec


class Attention(nn.Module):
    """Multi-head / grouped-query attention over the paged cache.

    forward(q [T, nq*hs], k [T, nk*hs], v [T, nk*hs]) -> [T, nq*hs]
    """

    kind = "mha"

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None, prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        self.spec = AttentionSpec(kind=self.kind, num_heads=num_heads,
                                  num_kv_heads=num_kv_heads or num_heads, head_size=head_size,
                                  scale=scale, sliding_window=sliding_window,
                                  logits_soft_cap=logits_soft_cap)
        self.kv_cache: torch.Tensor | None = None
        self.layer_index = -1  # position among the model's attention layers, set by the runner
        self.kv_scales: dict | None = None  # per-layer scales of a quantized KV cache

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        self.kv_cache = cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        backend = ctx.backends[self.kind]
        return backend.forward(self, q, k, v, self.kv_cache, ctx.attn_metadata)
