"""The ``triton`` attention backend: paged attention for mixed prefill + decode batches.

Per layer call: store the new K/V (slots < 0 skipped), run the decode kernel over the
first ``num_decodes`` rows (split along the context when the batch is small), then the
prefill kernel over the chunks. Batches may be captured in a CUDA graph: with ``meta.for_graph``
only tensors of ``meta`` are read, and the split count comes from the (static) batch size; a
captured batch that mixes prefill chunks in (``meta.mixed_graph``, ``pagoda.engine.mixed_graphs``)
runs both kernels over its capacity, the decode kernel's programs past the device's count of decodes
and the prefill kernel's padding tiles returning at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.interfaces import AttentionBackend, AttentionSpec

from pagoda_cuda.attention.availability import triton_unavailable_reason


@dataclass
class TritonMixedGraph:
    """The static state of a captured mixed batch (``meta.backend_data``; ``fill_mixed_graph`` writes it):
    the prefill kernel's tile map over a fixed number of tiles (padding tiles start past any chunk and
    return at once) and the number of decodes, the first sequences, on the device."""

    tile_map: Any  # [max tiles, 2] int32 (sequence, first query token), device
    host_tiles: Any  # its host mirror (page-locked on CUDA)
    num_decodes: Any  # [1] int32, device
    host_num_decodes: Any
    num_splits: dict[int, int] = field(default_factory=dict)  # num_kv_heads -> the decode kernel's, for the capacity


PADDING_TILE_START = 1 << 30  # a tile's first query token past any chunk: the program returns
MIXED_BLOCK_M = 64  # query rows per prefill tile in mixed graphs (the tile map is built for it)


@dataclass
class TritonStepData:
    """Per-step data shared by every layer (``meta.backend_data``)."""

    num_splits: dict[int, int] = field(default_factory=dict)  # num_kv_heads -> decode splits
    tile_maps: dict[int, Any] = field(default_factory=dict)  # BLOCK_M -> device tile map


class TritonPagedAttention(AttentionBackend):
    name = "triton"
    priority = 10
    platforms = ("cuda", "cpu")  # cpu only under TRITON_INTERPRET=1 (tests)
    auto_platforms = ("cuda",)  # on cpu only when named: attention_backend: triton
    kinds = ("mha",)
    dtypes = ("float32", "float16", "bfloat16")
    supports_graphs = True
    supports_mixed_graphs = True
    supports_sinks = True
    min_head_size, max_head_size = 16, 256

    def supports(self, platform: str, dtype: str, spec: AttentionSpec) -> str | None:
        why = super().supports(platform, dtype, spec)
        if why is not None:
            return why
        why = triton_unavailable_reason(platform)
        if why is not None:
            return why
        if not self.min_head_size <= spec.head_size <= self.max_head_size:
            return f"supports head sizes {self.min_head_size}-{self.max_head_size}, not {spec.head_size}"
        if spec.num_heads % spec.num_kv_heads:
            return f"num_heads {spec.num_heads} is not a multiple of num_kv_heads {spec.num_kv_heads}"
        return None

    def kv_cache_shape(self, spec: AttentionSpec, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Head-major pages, [2, num_blocks, nk, block_size, hs]: one head's tokens of a block are
        contiguous, so a decode program reads each page as one run (H200, Phi-3 shape: 526 ->
        501 us per layer; Qwen3 shapes equal). The kernels see it as [2, num_blocks, block_size,
        nk, hs] through a transpose (they address the cache by its strides)."""
        return (2, num_blocks, spec.num_kv_heads, block_size, spec.head_size)

    def prepare(self, meta) -> TritonStepData | TritonMixedGraph:
        if not meta.mixed_graph:
            return TritonStepData()
        if isinstance(meta.backend_data, TritonMixedGraph):  # a KV cache group's view: the same state
            return meta.backend_data
        import torch

        device = meta.seq_lens.device
        # every prefill chunk ends in a partial tile at most
        tiles = -(-meta.num_tokens // MIXED_BLOCK_M) + meta.num_seqs
        pinned = device.type == "cuda"
        data = TritonMixedGraph(torch.zeros(tiles, 2, dtype=torch.int32, device=device),
                                torch.zeros(tiles, 2, dtype=torch.int32, pin_memory=pinned),
                                torch.zeros(1, dtype=torch.int32, device=device),
                                torch.zeros(1, dtype=torch.int32, pin_memory=pinned))
        self.fill_mixed_graph(data, [0] * (meta.num_seqs + 1), 0)
        return data

    def fill_mixed_graph(self, data: TritonMixedGraph, query_start_loc, num_decodes: int) -> None:
        from pagoda_cuda.attention.prefill import build_tile_map

        tiles = build_tile_map(query_start_loc, num_decodes, MIXED_BLOCK_M)
        host = data.host_tiles.numpy()
        host[:len(tiles)] = tiles
        host[len(tiles):] = (0, PADDING_TILE_START)
        data.host_num_decodes[0] = num_decodes
        data.tile_map.copy_(data.host_tiles, non_blocking=True)
        data.num_decodes.copy_(data.host_num_decodes, non_blocking=True)

    def _splits(self, meta, data: TritonStepData, num_kv_heads: int, device) -> int:
        splits = data.num_splits.get(num_kv_heads)
        if splits is None:
            from pagoda_cuda.attention.decode import choose_splits

            splits = choose_splits(meta.num_decodes, num_kv_heads, meta.max_seq_len, device)
            data.num_splits[num_kv_heads] = splits
        return splits

    def forward(self, layer, q, k, v, kv_cache, meta):
        import torch
        from pagoda.layers.attention import is_quantized_kv_cache

        from pagoda_cuda.attention.decode import paged_decode
        from pagoda_cuda.attention.prefill import device_tile_map, paged_prefill, prefill_config
        from pagoda_cuda.ops.kv_store import store_kv_cache

        spec = layer.spec
        kv_cache = kv_cache.transpose(2, 3)  # head-major storage seen as [2, blocks, block_size, nk, hs]
        t = q.shape[0]
        nq, nk, hs = spec.num_heads, spec.num_kv_heads, spec.head_size
        q3, k3, v3 = q.view(t, nq, hs), k.view(t, nk, hs), v.view(t, nk, hs)
        scales = getattr(layer, "kv_scales", None) if is_quantized_kv_cache(kv_cache) else None
        if scales is not None:
            store_kv_cache(k3, v3, kv_cache, meta.slot_mapping[:t], scales["k_scale"], scales["v_scale"])
        else:
            store_kv_cache(k3, v3, kv_cache, meta.slot_mapping[:t])
        out = torch.empty((t, nq, hs), dtype=q.dtype, device=q.device)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        sinks = layer.sinks if spec.sinks else None
        if isinstance(meta.backend_data, TritonMixedGraph):  # every kernel over the capacity, counts on the device
            from pagoda_cuda.attention.decode import choose_splits

            mixed, s = meta.backend_data, meta.num_seqs
            splits = mixed.num_splits.setdefault(nk, choose_splits(s, nk, meta.max_seq_len, q.device))
            paged_decode(q3[:s], k_cache, v_cache, meta.block_tables, meta.seq_lens, out[:s], spec.scale, splits,
                         spec.sliding_window, spec.logits_soft_cap, kv_scales=scales, sinks=sinks,
                         num_decodes=mixed.num_decodes)
            paged_prefill(q3, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                          mixed.tile_map, out, spec.scale, spec.sliding_window, spec.logits_soft_cap,
                          config=(MIXED_BLOCK_M, *prefill_config(hs)[1:]), kv_scales=scales, sinks=sinks)
            return out.view(t, nq * hs)
        data = meta.backend_data if isinstance(meta.backend_data, TritonStepData) else TritonStepData()
        nd = meta.num_decodes
        if nd:
            paged_decode(q3[:nd], k_cache, v_cache, meta.block_tables, meta.seq_lens, out[:nd], spec.scale,
                         self._splits(meta, data, nk, q.device), spec.sliding_window, spec.logits_soft_cap,
                         kv_scales=scales, sinks=sinks)
        if meta.num_seqs > nd:
            if meta.for_graph:
                raise RuntimeError("the triton backend captures decode-only batches; this one has prefills")
            tiles = device_tile_map(data.tile_maps, meta.query_start_loc_cpu, nd, prefill_config(hs)[0], q.device)
            paged_prefill(q3, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, tiles,
                          out, spec.scale, spec.sliding_window, spec.logits_soft_cap, kv_scales=scales, sinks=sinks)
        return out.view(t, nq * hs)
