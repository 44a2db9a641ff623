"""CPU attention through ``torch.nn.functional.scaled_dot_product_attention``.

The reference backend (``torch``) materialises float32 scores [heads, Q, L] per sequence, so a
prompt's attention costs O(L^2) memory and a slow softmax pass; here torch's blocked (flash)
CPU kernel computes it in tiles, costing attention's FLOPs and no more.

- A prefill chunk that starts the sequence attends to its own new keys (no cache read), causally.
- A chunk after a cached prefix reads the keys back through the block table (a view when the
  sequence's blocks are consecutive in the cache, as for a single stream; else a gather) and
  uses a bottom-right causal mask (query i sees keys ``0..context+i``).
- Decodes (one query token each) read their keys and values straight through the block table in one
  C call for the whole batch (``cpu_ops.decode_attention``: float32 caches, with the C library built);
  otherwise they are batched into one torch call, each sequence's keys gathered and padded to the
  longest, masked by length (a single decode over consecutive blocks reads a view of the cache).

Soft-capped logits, fp8 caches and attention-map probes go to the reference backend.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from pagoda.attention.torch_paged import TorchPagedAttention
from pagoda.forward_context import AttentionMetadata, get_forward_context
from pagoda.interfaces import AttentionBackend
from pagoda.kernels import cpu_ops, get_op
from pagoda.layers.attention import is_quantized_kv_cache


class CpuStepData:
    """Per-step facts every layer reuses: for each sequence, the first cache block if its
    blocks are consecutive (``first_block[i] >= 0``); the decodes' block tables and lengths for the C
    decode attention; and, made only if a layer takes the torch path for two or more decodes, their
    padded block ids and key mask."""

    def __init__(self, meta: AttentionMetadata):
        lens = meta.seq_lens_cpu
        bs = meta.block_size
        tables = meta.block_tables.numpy() if meta.block_tables.device.type == "cpu" else None
        self.first_block = [-1] * meta.num_seqs
        if tables is not None:
            for i, length in enumerate(lens):
                n = -(-length // bs)
                row = tables[i, :n]
                if n and int(row[-1]) - int(row[0]) == n - 1 and (n < 3 or bool(np.all(np.diff(row) == 1))):
                    self.first_block[i] = int(row[0])
        self.num_decodes = meta.num_decodes
        self._meta = meta
        self._decode_inputs = None

    @functools.cached_property
    def decode_blocks(self) -> torch.Tensor:
        """int64 [B, blocks]: the decodes' block ids, as many as the longest of them needs (two or more
        decodes on the torch path; the C decode attention reads the block tables themselves)."""
        meta, nd = self._meta, self.num_decodes
        blocks = -(-max(meta.seq_lens_cpu[:nd]) // meta.block_size)
        return meta.block_tables[:nd, :blocks].long()

    @functools.cached_property
    def decode_mask(self) -> torch.Tensor:
        """bool [B, 1, 1, width]: which of ``decode_blocks``' key slots each decode sees (its length)."""
        meta, nd = self._meta, self.num_decodes
        width = self.decode_blocks.shape[1] * meta.block_size
        return (torch.arange(width)[None, :] < torch.tensor(meta.seq_lens_cpu[:nd])[:, None])[:, None, None, :]

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables int64 [B, max_blocks], lengths int64 [B]) of the step's decodes, made once a step."""
        if self._decode_inputs is None:
            meta, nd = self._meta, self.num_decodes
            self._decode_inputs = (meta.block_tables[:nd].to(torch.int64).contiguous(),
                                   torch.tensor(meta.seq_lens_cpu[:nd], dtype=torch.int64))
        return self._decode_inputs


def _cache_view(cache: torch.Tensor, first_block: int, length: int) -> torch.Tensor:
    """The first ``length`` rows of a sequence whose blocks start at ``first_block`` and are
    consecutive: [length, kv_heads, head_size], a view (no copy)."""
    bs = cache.shape[1]
    return cache.flatten(0, 1).narrow(0, first_block * bs, length)


def _keys(cache: torch.Tensor, block_table: torch.Tensor, first_block: int, length: int) -> torch.Tensor:
    if first_block >= 0:
        return _cache_view(cache, first_block, length)
    from pagoda.attention.torch_paged import gather_cache

    return gather_cache(cache, block_table, length)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask=None, causal=False):
    """q [Q, nq, d], k/v [L, nk, d] -> [Q, nq, d]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def _chunk_mask(num_q: int, length: int, window: int | None) -> torch.Tensor:
    """[Q, L] bool: query i (at position L - Q + i) sees key j when j <= its position (and within the window)."""
    qpos = torch.arange(length - num_q, length)[:, None]
    kpos = torch.arange(length)[None, :]
    allowed = kpos <= qpos
    if window:
        allowed &= kpos > qpos - window
    return allowed


class CpuSdpaAttention(AttentionBackend):
    name = "cpu_sdpa"
    priority = 5  # above the reference on the CPU
    platforms = ("cpu",)
    kinds = ("mha",)

    def __init__(self):
        self._reference = TorchPagedAttention()

    def prepare(self, meta: AttentionMetadata) -> CpuStepData:
        return CpuStepData(meta)

    def forward(self, layer, q, k, v, kv_cache, meta: AttentionMetadata):
        spec = layer.spec
        if spec.logits_soft_cap or is_quantized_kv_cache(kv_cache) or get_forward_context().attention_probe:
            return self._reference.forward(layer, q, k, v, kv_cache, meta)
        data: CpuStepData = meta.backend_data if isinstance(meta.backend_data, CpuStepData) else CpuStepData(meta)
        t = q.shape[0]
        nq, nk, hs = spec.num_heads, spec.num_kv_heads, spec.head_size
        q = q.view(t, nq, hs)
        k = k.view(t, nk, hs)
        v = v.view(t, nk, hs)
        get_op("store_kv_cache")(k, v, kv_cache, meta.slot_mapping[:t])
        out = torch.empty_like(q)
        nd = meta.num_decodes
        window = spec.sliding_window
        if nd and cpu_ops.decode_attention_supported(q, kv_cache):  # read through the block table in C
            tables, lens = data.decode_inputs()
            cpu_ops.decode_attention(out[:nd], q[:nd], kv_cache, tables, lens, window, spec.scale)
        elif nd == 1 or (nd and window):  # one at a time
            for i in range(nd):
                self._one(out, q, k, v, kv_cache, meta, data, i, window, spec.scale)
        elif nd:
            self._decodes(out, q, kv_cache, data, nd, spec.scale)
        for i in range(nd, meta.num_seqs):
            self._one(out, q, k, v, kv_cache, meta, data, i, window, spec.scale)
        return out.view(t, nq * hs)

    @staticmethod
    def _one(out, q, k, v, kv_cache, meta, data, i, window, scale):
        qs, qe, length = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1], meta.seq_lens_cpu[i]
        n = qe - qs
        if n == 0:
            return
        if n == length:  # the chunk is the whole sequence so far: its own keys, causal
            mask = _chunk_mask(n, length, window) if window and window < length else None
            out[qs:qe] = _sdpa(q[qs:qe], k[qs:qe], v[qs:qe], scale, mask, causal=mask is None)
            return
        keys = _keys(kv_cache[0], meta.block_tables[i], data.first_block[i], length)
        values = _keys(kv_cache[1], meta.block_tables[i], data.first_block[i], length)
        if n == 1 and not (window and window < length):
            out[qs:qe] = _sdpa(q[qs:qe], keys, values, scale)
            return
        out[qs:qe] = _sdpa(q[qs:qe], keys, values, scale, _chunk_mask(n, length, window))

    @staticmethod
    def _decodes(out, q, kv_cache, data: CpuStepData, nd: int, scale: float):
        """Every decode in one call: keys [B, nk, L, d] gathered by block, padding masked out."""
        blocks = data.decode_blocks
        width = data.decode_mask.shape[-1]

        padding = ~data.decode_mask[:, 0, 0, :]  # [B, width]: slots past each sequence's length

        def gather(cache):
            rows = cache.index_select(0, blocks.flatten()).view(nd, width, *cache.shape[2:])
            # slots past a sequence's length were never written (the CPU cache is not zeroed, and reused
            # memory holds anything): a NaN, or a huge key whose score overflows to inf, would survive
            # the mask (inf - inf = NaN), so padding is zeroed
            return rows.masked_fill_(padding[:, :, None, None], 0.0).transpose(1, 2)

        keys, values = gather(kv_cache[0]), gather(kv_cache[1])
        res = F.scaled_dot_product_attention(q[:nd, :, None, :], keys, values, attn_mask=data.decode_mask,
                                             scale=scale, enable_gqa=q.shape[1] != keys.shape[1])
        out[:nd] = res[:, :, 0, :]
