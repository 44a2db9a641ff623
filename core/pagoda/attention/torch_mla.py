"""Pure-torch MLA attention over the paged latent cache: the reference for MLA backends.

The interface (shapes, what is stored, how decodes and prefills attend) is documented in
``pagoda.layers.mla``. Decodes attend over the latent with the absorbed projections;
prefill chunks expand the cached latents into per-head K and V with ``kv_b_proj``'s weight.
An fp8 cache holds each entry divided by the layer's ``kv_scales["k_scale"]``.
"""

from __future__ import annotations

import torch

from pagoda.attention.torch_paged import attend, gather_cache
from pagoda.forward_context import AttentionMetadata, get_forward_context
from pagoda.interfaces import MLABackend
from pagoda.kernels import get_op
from pagoda.layers.attention import is_quantized_kv_cache


class TorchMLAAttention(MLABackend):
    name = "torch_mla"
    priority = 0
    platforms = ("*",)

    def forward_mla(self, layer, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_normed: torch.Tensor,
                    k_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q_nope [T,N,P], q_pe [T,N,R], kv_c_normed [T,L], k_pe [T,R], kv_cache [B, bs, L+R] -> [T,N,V]."""
        spec = layer.spec
        t, n = q_nope.shape[0], q_nope.shape[1]
        lora = spec.kv_lora_rank
        # an fp8 cache holds entry / k_scale (one scale for the latent and k_pe), read back times it
        scale = layer.kv_scales["k_scale"] if is_quantized_kv_cache(kv_cache) else None
        if scale is None:
            get_op("store_mla_cache")(kv_c_normed, k_pe, kv_cache, meta.slot_mapping[:t])
        else:
            get_op("store_mla_cache")(kv_c_normed, k_pe, kv_cache, meta.slot_mapping[:t], scale)
        w_uk, w_uv = layer.absorbed_weights()
        out = q_nope.new_empty(t, n, w_uv.shape[1])
        probe = get_forward_context().attention_probe
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(meta.num_seqs):
            qs, qe, length = starts[i], starts[i + 1], lens[i]
            if qe == qs:
                continue
            cached = gather_cache(kv_cache, meta.block_tables[i], length)  # [S, L+R]
            cached = (cached.float() * scale if scale is not None else cached).to(q_nope.dtype)
            latent, rope = cached[:, :lora], cached[:, lora:]
            if i < meta.num_decodes:
                o, probs = self._absorbed(q_nope[qs:qe], q_pe[qs:qe], latent, rope, w_uk, w_uv, spec.scale,
                                          length - (qe - qs))
            else:
                o, probs = self._expanded(q_nope[qs:qe], q_pe[qs:qe], latent, rope, w_uk, w_uv, spec.scale,
                                          length - (qe - qs))
            out[qs:qe] = o
            if probe is not None:
                probe(layer, i, probs)
        return out

    @staticmethod
    def _absorbed(q_nope, q_pe, latent, rope, w_uk, w_uv, scale, context_len):
        """Attention over the latent: one shared "KV head" of width L+R, values of width L."""
        q_latent = torch.einsum("qhp,hpl->qhl", q_nope, w_uk)  # [Q, N, L]
        q = torch.cat((q_latent, q_pe), dim=-1)
        keys = torch.cat((latent, rope), dim=-1).unsqueeze(1)  # [S, 1, L+R]
        o_latent, probs = attend(q, keys, latent.unsqueeze(1), scale, context_len)  # [Q, N, L]
        return torch.einsum("qhl,hvl->qhv", o_latent, w_uv), probs

    @staticmethod
    def _expanded(q_nope, q_pe, latent, rope, w_uk, w_uv, scale, context_len):
        """Per-head K = [w_uk c, k_pe], V = w_uv c for every cached token, then plain attention."""
        k_nope = torch.einsum("sl,hpl->shp", latent, w_uk)  # [S, N, P]
        values = torch.einsum("sl,hvl->shv", latent, w_uv)  # [S, N, V]
        keys = torch.cat((k_nope, rope.unsqueeze(1).expand(-1, k_nope.shape[1], -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        return attend(q, keys, values, scale, context_len)
