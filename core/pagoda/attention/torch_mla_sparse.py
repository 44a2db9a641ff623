"""Pure-torch DeepSeek sparse attention over the paged cache of ``[latent | k_pe | index_k]``
entries: the reference for ``mla_sparse`` backends (interface: ``pagoda.layers.sparse_mla``).

For each sequence of the batch: gather its cached entries, score them with the indexer, keep
each query's top-k visible tokens, then attend over those over the latent with the absorbed
projections (decodes and prefill chunks alike: the selection is per query).
"""

from __future__ import annotations

import torch

from pagoda.attention.torch_paged import gather_cache
from pagoda.forward_context import AttentionMetadata, get_forward_context
from pagoda.interfaces import AttentionBackend
from pagoda.kernels import get_op
from pagoda.layers.sparse_mla import index_scores, select_topk


def sparse_latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor,
                            chosen: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q_lat [Q, N, L], q_pe [Q, N, R]; latent [S, L], rope [S, R] of one sequence; chosen [Q, K]
    key positions (-1: none) -> (out_lat [Q, N, L], probs [N, Q, S] over every position)."""
    valid = chosen >= 0
    index = chosen.clamp(min=0)
    lat, pe = latent[index].float(), rope[index].float()  # [Q, K, L], [Q, K, R]
    scores = (torch.einsum("qnl,qkl->nqk", q_lat.float(), lat) + torch.einsum("qnr,qkr->nqk", q_pe.float(), pe))
    probs = torch.softmax(scores.mul(scale).masked_fill(~valid[None], float("-inf")), dim=-1)
    out = torch.einsum("nqk,qkl->qnl", probs, lat)
    full = probs.new_zeros(probs.shape[0], probs.shape[1], latent.shape[0])
    full.scatter_add_(2, index[None].expand_as(probs), probs)  # the attention-map probe's view
    return out.to(q_lat.dtype), full


class TorchSparseMLAAttention(AttentionBackend):
    name = "torch_mla_sparse"
    priority = 0
    platforms = ("*",)
    kinds = ("mla_sparse",)

    def kv_cache_shape(self, spec, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, spec.head_size)  # [latent | k_pe | index_k] per token

    def forward_sparse_mla(self, layer, q_nope, q_pe, kv_c_normed, k_pe, index_q, index_k, index_weights,
                           kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        spec = layer.spec
        t, n = q_nope.shape[0], q_nope.shape[1]
        lora, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
        # the entry is [latent | k_pe] followed by index_k: MLA's store op with the index key as the tail
        get_op("store_mla_cache")(torch.cat((kv_c_normed, k_pe), dim=-1), index_k, kv_cache, meta.slot_mapping[:t])
        w_uk, w_uv = layer.absorbed_weights()
        q_lat = torch.einsum("qnp,npl->qnl", q_nope, w_uk)
        out = q_nope.new_empty(t, n, w_uv.shape[1])
        probe = get_forward_context().attention_probe
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(meta.num_seqs):
            qs, qe, length = starts[i], starts[i + 1], lens[i]
            if qe == qs:
                continue
            cached = gather_cache(kv_cache, meta.block_tables[i], length)  # [S, L + R + Di]
            latent, keys_pe, keys_index = cached[:, :lora], cached[:, lora:lora + rope], cached[:, lora + rope:]
            positions = torch.arange(length - (qe - qs), length, device=q_nope.device)
            scores = index_scores(index_q[qs:qe], keys_index, index_weights[qs:qe])
            chosen = select_topk(scores, positions, spec.extra["index_topk"])
            o_lat, probs = sparse_latent_attention(q_lat[qs:qe], q_pe[qs:qe], latent, keys_pe, chosen, spec.scale)
            out[qs:qe] = torch.einsum("qnl,nvl->qnv", o_lat, w_uv)
            if probe is not None:
                probe(layer, i, probs)
        return out
