"""Multi-head Latent Attention (DeepSeek-V2/V3) over a paged cache of compressed latents.

The model computes, per token, the query heads and the compressed key/value latent; this
layer hands them to the selected backend of kind ``"mla"``. Names and shapes (per
tensor-parallel rank: N = local heads):

    P = qk_nope_head_dim   R = qk_rope_head_dim   V = v_head_dim   L = kv_lora_rank

    q_nope      [T, N, P]  query part without rotary
    q_pe        [T, N, R]  query part after rotary
    kv_c_normed [T, L]     compressed latent after kv_a_layernorm (shared by all heads)
    k_pe        [T, R]     key rotary part after rotary (shared by all heads)
    kv_cache    [num_blocks, block_size, L + R]   per token: kv_c_normed then k_pe

``kv_b_proj`` (the model's [N * (P + V), L] up-projection) gives, per head n, the absorbed
matrices ``w_uk[n]`` [P, L] (k_nope = w_uk[n] @ c) and ``w_uv[n]`` [V, L] (v = w_uv[n] @ c);
``MLAAttention.absorbed_weights()`` returns them as views of ``kv_b_weight()``: its weight (or
its dequantized weight when the projection is quantized: a quant method exposing
``dequantize(layer) -> [out, in]`` tensor), whole, for backends that expand latents with it.

Backend contract (``AttentionBackend`` of kind ``"mla"``)::

    forward_mla(layer, q_nope, q_pe, kv_c_normed, k_pe, kv_cache, meta) -> [T, N, V]

It stores (kv_c_normed, k_pe) at ``meta.slot_mapping`` (op ``store_mla_cache``), then for
each sequence of the batch attends its new tokens causally over its cached tokens through
``meta.block_tables`` with softmax scale ``layer.spec.scale``. An fp8 cache
(``is_quantized_kv_cache``) holds ``clamp(entry / k_scale)`` with the layer's
``kv_scales["k_scale"]`` (one scale for latent and k_pe; ``store_mla_cache``'s fifth
argument) and is read back as ``cached * k_scale``:

    score(t, s) = q_nope[t] . k_nope[s] + q_pe[t] . k_pe[s],   out[t] = sum_s p(t, s) v[s]

Decodes (the first ``meta.num_decodes`` sequences, one token each) attend over the latent
directly with the absorbed projections: q_lat = q_nope @ w_uk (per head, [N, L]),
score = q_lat . c + q_pe . k_pe, out = (sum_s p c_s) @ w_uv^T. Prefill chunks may expand
K/V from the latents instead (fewer FLOPs for long chunks). ``layer.spec`` carries N
(``num_heads``), L (``kv_lora_rank``), R (``qk_rope_head_dim``) and, in ``spec.extra``,
P (``qk_nope_head_dim``) and V (``v_head_dim``).
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.forward_context import get_forward_context
from pagoda.interfaces import AttentionSpec
from pagoda.layers.attention import Attention


class MLAAttention(Attention):
    """forward(q_nope [T,N,P], q_pe [T,N,R], kv_c_normed [T,L], k_pe [T,R]) -> [T, N*V]."""

    kind = "mla"

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, scale: float, kv_b_proj: nn.Module, prefix: str = ""):
        # Attention's own state (cache binding, layer index, KV scales), then the MLA spec
        super().__init__(num_heads, kv_lora_rank + qk_rope_head_dim, scale, num_kv_heads=1, prefix=prefix)
        self.spec = AttentionSpec(kind=self.kind, num_heads=num_heads, num_kv_heads=1,
                                  head_size=kv_lora_rank + qk_rope_head_dim, scale=scale,
                                  kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                                  extra={"qk_nope_head_dim": qk_nope_head_dim, "v_head_dim": v_head_dim})
        self.num_heads = num_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = v_head_dim, kv_lora_rank
        self._kv_b_proj = (kv_b_proj,)  # a tuple: the model owns (and loads) the projection
        self._kv_b_weight: torch.Tensor | None = None
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def kv_b_proj(self) -> nn.Module:
        return self._kv_b_proj[0]

    def kv_b_weight(self) -> torch.Tensor:
        """kv_b_proj's weight [N * (P + V), L] in the model dtype (dequantized once if quantized)."""
        if self._kv_b_weight is None:
            proj = self.kv_b_proj
            dequantize = getattr(getattr(proj, "quant_method", None), "dequantize", None)
            # dequantize returns float32; the absorbed matmuls run in the model dtype
            self._kv_b_weight = dequantize(proj).to(proj.params_dtype) if dequantize is not None else proj.weight
        return self._kv_b_weight

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_uk [N, P, L], w_uv [N, V, L]): views of ``kv_b_weight()``, made once after loading."""
        if self._absorbed is None:
            w = self.kv_b_weight().view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
            self._absorbed = (w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:])
        return self._absorbed

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_normed: torch.Tensor,
                k_pe: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        backend = ctx.backends[self.kind]
        out = backend.forward_mla(self, q_nope, q_pe, kv_c_normed, k_pe, self.kv_cache, ctx.metadata_for(self.kind))
        return out.reshape(q_nope.shape[0], self.num_heads * self.v_head_dim)
