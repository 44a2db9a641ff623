"""The ``triton_mla`` backend: MLA over the paged latent cache (interface: ``pagoda.layers.mla``).

Decodes attend over the latent with the absorbed projections (``mla_decode``), bracketed by
two batched matmuls (q_nope @ w_uk before, latent @ w_uv^T after); graph-capturable. Prefill
chunks expand each prefill sequence's cached latents into per-head [k_nope | v] rows (one GEMM)
and run the paged prefill kernel over them as a cache of one-token pages, reading the rotary
parts of queries and keys from their own tensors (nothing is concatenated).
An fp8 cache holds entry / ``layer.kv_scales["k_scale"]``: stored, decoded and expanded with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.interfaces import AttentionSpec, MLABackend

from pagoda_cuda.attention.availability import triton_unavailable_reason


@dataclass
class MLAStepData:
    num_splits: dict[int, int] = field(default_factory=dict)  # heads -> decode splits
    prefill: dict | None = None  # host-built index tensors of the expanded prefill


class TritonMLAAttention(MLABackend):
    name = "triton_mla"
    priority = 10
    platforms = ("cuda", "cpu")  # cpu only under TRITON_INTERPRET=1 (tests)
    auto_platforms = ("cuda",)
    dtypes = ("float32", "float16", "bfloat16")
    supports_graphs = True

    def supports(self, platform: str, dtype: str, spec: AttentionSpec) -> str | None:
        why = super().supports(platform, dtype, spec)
        if why is not None:
            return why
        why = triton_unavailable_reason(platform)
        if why is not None:
            return why
        if spec.kv_lora_rank > 1024 or spec.qk_rope_head_dim > 256:
            return (f"supports kv_lora_rank <= 1024 and qk_rope_head_dim <= 256, not "
                    f"{spec.kv_lora_rank} and {spec.qk_rope_head_dim}")
        return None

    def prepare(self, meta) -> MLAStepData:
        return MLAStepData()

    def _prefill_index(self, meta, data: MLAStepData, device) -> dict:
        """Per prefill sequence: its cached tokens' slots, one-token-page tables and offsets."""
        if data.prefill is None:
            import numpy as np
            import torch

            nd = meta.num_decodes
            lens = np.asarray(meta.seq_lens_cpu[nd:], dtype=np.int64)
            qsl = np.asarray(meta.query_start_loc_cpu[nd:], dtype=np.int64) - meta.query_start_loc_cpu[nd]
            offsets = np.concatenate(([0], np.cumsum(lens)))
            seq_of = np.repeat(np.arange(len(lens)), lens)
            pos = np.arange(offsets[-1]) - offsets[:-1][seq_of]
            width = int(lens.max())
            tables = np.where(np.arange(width)[None, :] < lens[:, None], offsets[:-1, None] + np.arange(width), 0)

            from pagoda.kernels.host_upload import upload

            def dev(a, dtype):
                return upload(a, device, dtype)

            data.prefill = {
                "seq_of": dev(seq_of + nd, torch.int64), "pos": dev(pos, torch.int64),
                "tables": dev(tables, torch.int32), "seq_lens": dev(lens, torch.int32),
                "qsl": dev(qsl, torch.int32), "total": int(offsets[-1]),
                "tile_maps": {}, "qsl_host": qsl.tolist(),
            }
        return data.prefill

    def forward_mla(self, layer, q_nope, q_pe, kv_c_normed, k_pe, kv_cache, meta):
        import torch
        from pagoda.layers.attention import is_quantized_kv_cache

        from pagoda_cuda.attention.mla_decode import mla_decode, mla_splits, store_mla_cache

        spec = layer.spec
        t, heads = q_nope.shape[0], q_nope.shape[1]
        lora = spec.kv_lora_rank
        kv_scale = layer.kv_scales["k_scale"] if is_quantized_kv_cache(kv_cache) else None
        store_mla_cache(kv_c_normed, k_pe, kv_cache, meta.slot_mapping[:t], kv_scale)
        w_uk, w_uv = layer.absorbed_weights()  # [N, P, L], [N, V, L]
        out = q_nope.new_empty(t, heads, w_uv.shape[1])
        data = meta.backend_data if isinstance(meta.backend_data, MLAStepData) else MLAStepData()
        nd = meta.num_decodes
        if nd:
            splits = data.num_splits.get(heads)
            if splits is None:
                splits = data.num_splits[heads] = mla_splits(nd, heads, meta.max_seq_len, q_nope.device, lora)
            q_lat = torch.bmm(q_nope[:nd].transpose(0, 1), w_uk).transpose(0, 1)  # [nd, N, L]
            o_lat = torch.empty((nd, heads, lora), dtype=q_nope.dtype, device=q_nope.device)
            q_pe_d = q_pe[:nd] if q_pe.stride(-1) == 1 else q_pe[:nd].contiguous()
            mla_decode(q_lat, q_pe_d, kv_cache, meta.block_tables, meta.seq_lens, o_lat, spec.scale, splits,
                       kv_scale)
            out[:nd] = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        if meta.num_seqs > nd:
            if meta.for_graph:
                raise RuntimeError("the triton_mla backend captures decode-only batches; this one has prefills")
            self._prefill(layer, q_nope[nd:], q_pe[nd:], kv_cache, meta, data, out[nd:], kv_scale)
        return out

    def _prefill(self, layer, q_nope, q_pe, kv_cache, meta, data, out, kv_scale=None) -> None:
        import torch

        from pagoda_cuda.attention.prefill import device_tile_map, paged_prefill, prefill_config

        spec = layer.spec
        lora = spec.kv_lora_rank
        idx = self._prefill_index(meta, data, q_nope.device)
        heads, nope = q_nope.shape[1], q_nope.shape[2]
        # gather every prefill sequence's cached latents (the new tokens are stored already)
        block = meta.block_size
        pages = meta.block_tables[idx["seq_of"], idx["pos"] // block].long()
        entries = kv_cache.view(-1, kv_cache.shape[-1]).index_select(0, pages * block + idx["pos"] % block)
        entries = (entries.float() * kv_scale if kv_scale is not None else entries).to(q_nope.dtype)
        latent, rope = entries[:, :lora], entries[:, lora:]
        total = idx["total"]
        # one GEMM expands the latents into every head's [k_nope | v] row (the kv_b projection); the
        # kernel reads k_nope and v from it in place and the rotary parts of queries and keys from
        # their own tensors (k_pe shared by the heads), so nothing is concatenated
        kv = torch.nn.functional.linear(latent, layer.kv_b_weight()).view(total, heads, -1)  # [S, N, P + V]
        keys = kv[..., :nope].unsqueeze(1)  # [S, 1, N, P]: one-token pages
        values = kv[..., nope:].unsqueeze(1)  # [S, 1, N, V]
        block_m = prefill_config(nope + rope.shape[-1], values.shape[-1])[0]
        tiles = device_tile_map(idx["tile_maps"], idx["qsl_host"], 0, block_m, q_nope.device)
        paged_prefill(q_nope, keys, values, idx["tables"], idx["seq_lens"], idx["qsl"], tiles, out, spec.scale,
                      q_rope=q_pe, k_rope=rope.unsqueeze(1))
