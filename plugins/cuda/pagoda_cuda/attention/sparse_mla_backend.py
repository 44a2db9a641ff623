"""The ``triton_mla_sparse`` backend: DeepSeek sparse attention (kind ``mla_sparse``, interface
``pagoda.layers.sparse_mla``) over the paged ``[latent | k_pe | index_k]`` cache.

Per layer call: store the new entries (MLA's store kernel, the index key as the tail), score
every visible cached token with the indexer (``index_logits``), ``torch.topk`` per query token,
then attend over the chosen tokens (``sparse_mla``) between the absorbed projections (two
batched matmuls). Decode-only batches are graph-capturable: each decode token is its sequence's
row and its position is ``seq_len - 1``, both computed on the device; the logits are as wide as
the block table (static under a graph) instead of the batch's longest sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.interfaces import AttentionBackend, AttentionSpec

from pagoda_cuda.attention.availability import triton_unavailable_reason


@dataclass
class SparseStepData:
    seq_of: Any = None  # [T] int32: each token's row of the block tables (mixed batches; built on the host)
    positions: Any = None  # [T] int32: each token's position


class TritonSparseMLAAttention(AttentionBackend):
    name = "triton_mla_sparse"
    priority = 10
    platforms = ("cuda", "cpu")  # cpu only under TRITON_INTERPRET=1 (tests)
    auto_platforms = ("cuda",)
    kinds = ("mla_sparse",)
    dtypes = ("float32", "float16", "bfloat16")
    supports_graphs = True

    def supports(self, platform: str, dtype: str, spec: AttentionSpec) -> str | None:
        why = super().supports(platform, dtype, spec) or triton_unavailable_reason(platform)
        if why is not None:
            return why
        if spec.kv_lora_rank > 1024 or spec.qk_rope_head_dim > 256 or spec.extra.get("index_head_dim", 0) > 256:
            return "supports kv_lora_rank <= 1024, qk_rope_head_dim and index_head_dim <= 256"
        return None

    def kv_cache_shape(self, spec, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, spec.head_size)

    def prepare(self, meta) -> SparseStepData:
        if meta.for_graph or meta.num_decodes == meta.num_seqs:
            return SparseStepData()  # decodes: computed on the device in forward
        import numpy as np
        from pagoda.kernels.host_upload import upload

        qsl = np.asarray(meta.query_start_loc_cpu, dtype=np.int64)
        new = qsl[1:] - qsl[:-1]
        seq_of = np.repeat(np.arange(meta.num_seqs), new)
        ends = np.asarray(meta.seq_lens_cpu, dtype=np.int64)
        positions = np.arange(qsl[-1]) - np.repeat(qsl[:-1], new) + np.repeat(ends - new, new)
        device = meta.seq_lens.device
        return SparseStepData(upload(seq_of.astype(np.int32), device), upload(positions.astype(np.int32), device))

    def forward_sparse_mla(self, layer, q_nope, q_pe, kv_c_normed, k_pe, index_q, index_k, index_weights,
                           kv_cache, meta):
        import torch

        from pagoda_cuda.attention.mla_decode import store_mla_cache
        from pagoda_cuda.attention.sparse_mla import index_logits, sparse_mla

        spec = layer.spec
        t, heads = q_nope.shape[0], q_nope.shape[1]
        lora, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
        store_mla_cache(torch.cat((kv_c_normed, k_pe), dim=-1), index_k, kv_cache, meta.slot_mapping[:t])
        data = meta.backend_data if isinstance(meta.backend_data, SparseStepData) else None
        if data is None or data.seq_of is None:  # decodes only: token i is sequence i
            seq_of = torch.arange(t, dtype=torch.int32, device=q_nope.device)
            positions = meta.seq_lens[:t] - 1
        else:
            seq_of, positions = data.seq_of, data.positions
        width = meta.block_tables.shape[1] * meta.block_size if meta.for_graph else meta.max_seq_len
        logits = index_logits(index_q, index_weights, kv_cache, meta.block_tables, seq_of, positions, width,
                              lora + rope)
        values, chosen = logits.topk(min(spec.extra["index_topk"], width), dim=-1)
        chosen = chosen.masked_fill(values == float("-inf"), -1)
        w_uk, w_uv = layer.absorbed_weights()  # [N, P, L], [N, V, L]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, N, L]
        o_lat = torch.empty((t, heads, lora), dtype=q_nope.dtype, device=q_nope.device)
        q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
        sparse_mla(q_lat, q_pe, kv_cache, meta.block_tables, seq_of, chosen, o_lat, spec.scale)
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
