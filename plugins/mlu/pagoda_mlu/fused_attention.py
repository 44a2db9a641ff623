"""``mlu_fused``: attention through torch_mlu_ops where its kernels fit, tiles elsewhere.

Same head-major cache as ``mlu_chunked`` (whose cache write resolves to
``tmo.reshape_paged_cache`` on the MLU). Per batch:

- decode rows: one ``tmo.single_query_cached_kv_attn`` over the paged cache (block sizes 1-64,
  the sizes that kernel documents; other block sizes use the tiles);
- prefill chunks with no cached context (a whole prompt at once): one packed causal
  ``tmo.flash_attention`` over the chunk's own q/k/v;
- prefill chunks that continue a cached context: ``mlu_chunked``'s tiles.

Sliding windows map to the kernels' ``window_size_left = window - 1`` (they attend to
``window_size_left + 1`` keys). Logit soft-capping has no torch_mlu_ops equivalent, so such
models get ``mlu_chunked``. Never run on MLU hardware yet (docs/mlu.md).
"""

from __future__ import annotations

import torch
from pagoda.forward_context import AttentionMetadata
from pagoda.interfaces import AttentionSpec

from pagoda_mlu.chunked_attention import MluChunkedAttention
from pagoda_mlu.runtime import TORCH_MLU_OPS, torch_mlu_ops_importable
from pagoda_mlu.tmo_kernels import tmo

SINGLE_QUERY_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64)


class MluFusedAttention(MluChunkedAttention):
    name = "mlu_fused"
    priority = 10  # above mlu_chunked: on an MLU with torch_mlu_ops, auto picks this one
    platforms = ("mlu",)
    auto_platforms = ("mlu",)
    kinds = ("mha",)  # MLA layers get mlu_chunked (torch_mlu_ops MLA kernels are not wired yet)

    def supports(self, platform: str, dtype: str, spec: AttentionSpec) -> str | None:
        why = super().supports(platform, dtype, spec)
        if why is not None:
            return why
        if not torch_mlu_ops_importable():
            return f"{TORCH_MLU_OPS} (Cambricon's fused kernels, shipped with its SDK) is not importable"
        if spec.logits_soft_cap:
            return f"{TORCH_MLU_OPS} attention has no logit soft-capping"
        return None

    def attend(self, q, k, v, out, kv_cache, meta: AttentionMetadata, spec: AttentionSpec,
               kv_scales: dict | None = None) -> None:
        if kv_scales is not None or kv_cache.dtype != q.dtype:  # an fp8 cache: the tiles rescale it
            super().attend(q, k, v, out, kv_cache, meta, spec, kv_scales)
            return
        lib = tmo()
        window = spec.sliding_window - 1 if spec.sliding_window else -1
        if kv_cache.shape[3] in SINGLE_QUERY_BLOCK_SIZES:
            self.fused_decodes(lib, q, out, kv_cache, meta, spec, window)
        else:
            self.decode_rows(q, out, kv_cache[0], kv_cache[1], meta, spec)
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        prefills = range(meta.num_decodes, meta.num_seqs)
        fresh = [i for i in prefills if lens[i] == starts[i + 1] - starts[i]]  # no cached context
        self.fused_fresh_prefills(lib, q, k, v, out, meta, spec, fresh, window)
        continuing = [i for i in prefills if lens[i] != starts[i + 1] - starts[i]]
        self.prefill_rows(q, out, kv_cache[0], kv_cache[1], meta, spec, continuing)

    def fused_decodes(self, lib, q, out, kv_cache, meta: AttentionMetadata, spec: AttentionSpec,
                      window: int) -> None:
        nd = meta.num_decodes
        if nd == 0:
            return
        # q/out [nd, 1, nq, hs]: a batch of one-token queries; caches [num_blocks, nk, block_size, hs].
        result = out[:nd].unsqueeze(1)
        lib.single_query_cached_kv_attn(
            q[:nd].contiguous().unsqueeze(1), kv_cache[0], kv_cache[1], result,
            meta.block_tables[:nd].to(torch.int32), meta.seq_lens[:nd].to(torch.int32), None, None, None,
            max(meta.seq_lens_cpu[:nd]), window, -1, spec.scale)

    def fused_fresh_prefills(self, lib, q, k, v, out, meta: AttentionMetadata, spec: AttentionSpec,
                             seqs: list[int], window: int) -> None:
        if not seqs:
            return
        starts = meta.query_start_loc_cpu
        lengths = [starts[i + 1] - starts[i] for i in seqs]
        cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(q.device)
        contiguous = seqs == list(range(seqs[0], seqs[-1] + 1))
        if contiguous:  # the usual case: every prefill of the step starts fresh
            rows = slice(starts[seqs[0]], starts[seqs[-1] + 1])
            qf, kf, vf = q[rows], k[rows], v[rows]
        else:
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs]).to(q.device)
            qf, kf, vf = q.index_select(0, rows), k.index_select(0, rows), v.index_select(0, rows)
        result = torch.empty(qf.shape, dtype=q.dtype, device=q.device)
        lib.flash_attention(qf.contiguous(), kf.contiguous(), vf.contiguous(), result, cu, cu, None, None,
                            max(lengths), max(lengths), spec.scale, True, window, -1, torch.float32, False)
        if contiguous:
            out[rows] = result
        else:
            out.index_copy_(0, rows, result)
