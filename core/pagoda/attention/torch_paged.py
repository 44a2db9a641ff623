"""Pure-torch paged attention: the reference every other backend is tested against.

For each sequence of the mixed batch it gathers the cached K/V through the block table
and attends causally from the new tokens (query i of a chunk that starts after ``ctx``
cached tokens sees keys ``0..ctx+i``), with grouped-query heads, an optional sliding
window and logit soft-capping. An fp8 cache holds k / k_scale with per-layer scales
(``Attention.kv_scales``), multiplied back after the gather.
"""

from __future__ import annotations

import torch

from pagoda.forward_context import AttentionMetadata, get_forward_context
from pagoda.interfaces import AttentionBackend
from pagoda.kernels import get_op
from pagoda.layers.attention import is_quantized_kv_cache


def gather_cache(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """cache [num_blocks, block_size, ...] -> the first ``length`` token rows of a sequence."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-length // block_size)].long()
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, context_len: int,
           sliding_window: int | None = None, soft_cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Q, nq, d], k [L, nk, d], v [L, nk, dv] with L = context_len + Q.
    Returns (out [Q, nq, dv], probs [nq, Q, L])."""
    nq, nk = q.shape[1], k.shape[1]
    if nq != nk:
        k = k.repeat_interleave(nq // nk, dim=1)
        v = v.repeat_interleave(nq // nk, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    n_q, n_k = q.shape[0], k.shape[0]
    qpos = torch.arange(n_q, device=q.device)[:, None] + context_len
    kpos = torch.arange(n_k, device=q.device)[None, :]
    allowed = kpos <= qpos
    if sliding_window:
        allowed &= kpos > qpos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v.float())
    return out.to(q.dtype), probs


class TorchPagedAttention(AttentionBackend):
    name = "torch"
    priority = 0
    platforms = ("*",)
    kinds = ("mha",)

    def forward(self, layer, q, k, v, kv_cache, meta: AttentionMetadata):
        spec = layer.spec
        t = q.shape[0]
        nq, nk, hs = spec.num_heads, spec.num_kv_heads, spec.head_size
        q = q.view(t, nq, hs)
        k = k.view(t, nk, hs)
        v = v.view(t, nk, hs)
        scales = layer.kv_scales if is_quantized_kv_cache(kv_cache) else None
        if scales is None:
            get_op("store_kv_cache")(k, v, kv_cache, meta.slot_mapping[:t])
        else:  # fp8 cache: store k / k_scale, read back times k_scale
            get_op("store_kv_cache")(k, v, kv_cache, meta.slot_mapping[:t], scales["k_scale"], scales["v_scale"])
        out = torch.empty_like(q)
        probe = get_forward_context().attention_probe
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(meta.num_seqs):
            qs, qe, length = starts[i], starts[i + 1], lens[i]
            if qe == qs:
                continue
            keys = gather_cache(kv_cache[0], meta.block_tables[i], length)
            values = gather_cache(kv_cache[1], meta.block_tables[i], length)
            if scales is not None:
                keys, values = keys.float() * scales["k_scale"], values.float() * scales["v_scale"]
            o, probs = attend(q[qs:qe], keys, values, spec.scale, length - (qe - qs),
                              spec.sliding_window, spec.logits_soft_cap)
            out[qs:qe] = o
            if probe is not None:
                probe(layer, i, probs)
        return out.view(t, nq * hs)
