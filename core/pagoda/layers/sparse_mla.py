"""DeepSeek Sparse Attention (DeepSeek-V3.2): MLA over the ``index_topk`` cached tokens a
lightning indexer picks for each query.

Per token the model computes MLA's query parts and latent (as ``pagoda.layers.mla``) and the
indexer's inputs (Hi = index_n_heads, Di = index_head_dim):

    index_q       [T, Hi, Di]  indexer queries (rotary on the first R dims, halves not pairs)
    index_k       [T, Di]      indexer key (LayerNorm, then the same rotary), one per token
    index_weights [T, Hi]      float32 head weights, times Hi^-0.5 * Di^-0.5

The cache (kind ``"mla_sparse"``) holds per token ``[kv_c_normed | k_pe | index_k]``, L + R + Di
values: the latent cache of MLA with the index key appended (the "index cache", one more KV
layout on the same block tables). A query at position p scores every cached key s <= p as

    index(p, s) = sum_h index_weights[p, h] * relu(index_q[p, h] . index_k[s])

keeps the ``min(index_topk, p + 1)`` best (``torch.topk`` order; ties are whatever the backend's
top-k gives) and attends MLA's way over those tokens only: score = q_nope . k_nope + q_pe . k_pe
with the absorbed ``w_uk`` / ``w_uv`` of ``MLAAttention``, softmax scale ``spec.scale``.

Backend contract (``AttentionBackend`` of kind ``"mla_sparse"``)::

    forward_sparse_mla(layer, q_nope, q_pe, kv_c_normed, k_pe, index_q, index_k, index_weights,
                       kv_cache, meta) -> [T, N, V]

storing the new tokens' entries at ``meta.slot_mapping`` first. ``layer.spec.extra`` carries P, V,
``index_head_dim`` and ``index_topk``. An fp8 cache is not supported for this kind yet.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.errors import ConfigError
from pagoda.forward_context import get_forward_context
from pagoda.interfaces import AttentionSpec
from pagoda.layers.attention import is_quantized_kv_cache
from pagoda.layers.mla import MLAAttention


class SparseMLAAttention(MLAAttention):
    """forward(q_nope [T,N,P], q_pe [T,N,R], kv_c_normed [T,L], k_pe [T,R], index_q [T,Hi,Di],
    index_k [T,Di], index_weights [T,Hi]) -> [T, N*V]."""

    kind = "mla_sparse"

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, scale: float, kv_b_proj: nn.Module, index_head_dim: int, index_topk: int,
                 prefix: str = ""):
        super().__init__(num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank, scale, kv_b_proj,
                         prefix)
        self.spec = AttentionSpec(kind=self.kind, num_heads=num_heads, num_kv_heads=1,
                                  head_size=kv_lora_rank + qk_rope_head_dim + index_head_dim, scale=scale,
                                  kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                                  extra={"qk_nope_head_dim": qk_nope_head_dim, "v_head_dim": v_head_dim,
                                         "index_head_dim": index_head_dim, "index_topk": index_topk})
        self.index_head_dim, self.index_topk = index_head_dim, index_topk

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        if is_quantized_kv_cache(cache):
            raise ConfigError("kv_cache_dtype fp8 is not supported for DeepSeek sparse attention (mla_sparse) yet; "
                              "use kv_cache_dtype auto")
        super().bind_kv_cache(cache)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                index_q: torch.Tensor, index_k: torch.Tensor, index_weights: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        backend = ctx.backends[self.kind]
        out = backend.forward_sparse_mla(self, q_nope, q_pe, kv_c_normed, k_pe, index_q, index_k, index_weights,
                                         self.kv_cache, ctx.metadata_for(self.kind))
        return out.reshape(q_nope.shape[0], self.num_heads * self.v_head_dim)


def index_scores(index_q: torch.Tensor, index_keys: torch.Tensor, index_weights: torch.Tensor) -> torch.Tensor:
    """index_q [Q, Hi, Di], index_keys [S, Di], index_weights [Q, Hi] -> [Q, S] float32:
    sum over heads of weight * relu(q . k) (the indexer's score, before the causal mask)."""
    dots = torch.einsum("qhd,sd->qhs", index_q.float(), index_keys.float()).relu_()
    return torch.einsum("qh,qhs->qs", index_weights.float(), dots)


def select_topk(scores: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [Q, S] (keys at positions 0..S-1), positions [Q] of the queries -> [Q, min(topk, S)]
    int64 key positions, -1 where a query has fewer visible keys than slots."""
    keys = torch.arange(scores.shape[1], device=scores.device)
    visible = keys[None, :] <= positions[:, None]
    masked = scores.masked_fill(~visible, float("-inf"))
    values, chosen = masked.topk(min(topk, scores.shape[1]), dim=-1)
    return chosen.masked_fill(values == float("-inf"), -1)
