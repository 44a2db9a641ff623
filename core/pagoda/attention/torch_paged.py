"""Pure-torch paged attention: the reference every other backend is tested against.

For each sequence of the mixed batch it gathers the cached K/V through the block table
and attends causally from the new tokens (query i of a chunk that starts after ``ctx``
cached tokens sees keys ``0..ctx+i``), with grouped-query heads, an optional sliding
window, logit soft-capping and per-head attention sinks. An fp8 cache holds k / k_scale with
per-layer scales (``Attention.kv_scales``), multiplied back after the gather. With a sliding
window only the blocks from the first one a query of the chunk sees are gathered: the blocks
before it may have been freed (``BlockManager`` releases blocks that left every window).
"""

from __future__ import annotations

import torch

from pagoda.forward_context import AttentionMetadata, get_forward_context
from pagoda.interfaces import AttentionBackend
from pagoda.kernels import get_op
from pagoda.layers.attention import is_quantized_kv_cache


def gather_cache(cache: torch.Tensor, block_table: torch.Tensor, length: int, first_block: int = 0) -> torch.Tensor:
    """cache [num_blocks, block_size, ...] -> token rows ``first_block * block_size .. length - 1``
    of a sequence."""
    block_size = cache.shape[1]
    blocks = block_table[first_block: -(-length // block_size)].long()
    return cache.index_select(0, blocks).flatten(0, 1)[: length - first_block * block_size]


def window_first_block(length: int, num_new: int, block_size: int, sliding_window: int | None) -> int:
    """The first cache block a chunk's queries can see: the one holding key position
    ``first query - window + 1`` (0 without a window)."""
    if not sliding_window:
        return 0
    return max(0, length - num_new - sliding_window + 1) // block_size


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, context_len: int,
           sliding_window: int | None = None, soft_cap: float | None = None, sinks: torch.Tensor | None = None,
           key_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Q, nq, d], k [L, nk, d], v [L, nk, dv]: the keys at positions ``key_offset ..
    key_offset + L - 1``, the queries at ``context_len .. context_len + Q - 1``, with
    ``key_offset + L = context_len + Q``. ``sinks`` [nq]: a sink logit per head that joins the
    softmax and is dropped from the output. Returns (out [Q, nq, dv], probs [nq, Q, L])."""
    nq, nk = q.shape[1], k.shape[1]
    if nq != nk:
        k = k.repeat_interleave(nq // nk, dim=1)
        v = v.repeat_interleave(nq // nk, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    n_q, n_k = q.shape[0], k.shape[0]
    qpos = torch.arange(n_q, device=q.device)[:, None] + context_len
    kpos = torch.arange(n_k, device=q.device)[None, :] + key_offset
    allowed = kpos <= qpos
    if sliding_window:
        allowed &= kpos > qpos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # one more logit per head, in the denominator only
        sink = sinks.float().view(-1, 1, 1).expand(-1, n_q, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v.float())
    return out.to(q.dtype), probs


class TorchPagedAttention(AttentionBackend):
    name = "torch"
    priority = 0
    platforms = ("*",)
    kinds = ("mha",)
    supports_sinks = True

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
        block_size = kv_cache.shape[2]
        sinks = layer.sinks if spec.sinks else None
        for i in range(meta.num_seqs):
            qs, qe, length = starts[i], starts[i + 1], lens[i]
            if qe == qs:
                continue
            first = window_first_block(length, qe - qs, block_size, spec.sliding_window)
            keys = gather_cache(kv_cache[0], meta.block_tables[i], length, first)
            values = gather_cache(kv_cache[1], meta.block_tables[i], length, first)
            if scales is not None:
                keys, values = keys.float() * scales["k_scale"], values.float() * scales["v_scale"]
            o, probs = attend(q[qs:qe], keys, values, spec.scale, length - (qe - qs),
                              spec.sliding_window, spec.logits_soft_cap, sinks, first * block_size)
            if first and probe is not None:  # the probe sees every position of the sequence
                probs = torch.nn.functional.pad(probs, (first * block_size, 0))
            out[qs:qe] = o
            if probe is not None:
                probe(layer, i, probs)
        return out.view(t, nq * hs)
