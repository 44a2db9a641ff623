"""Write each new token's K and V into the paged cache at its slot (slots < 0 are padding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_cuda._triton import next_pow2, pdl, wait_for_inputs


@triton.jit
def _store_kv_kernel(k_ptr, k_stride_t, k_stride_h, v_ptr, v_stride_t, v_stride_h, kc_ptr, vc_ptr,
                     stride_cb, stride_cs, stride_ch, page, slot_ptr, k_scale_ptr, v_scale_ptr, limit, num_heads,
                     HEAD: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SCALE: tl.constexpr,
                     PDL: tl.constexpr):
    # one program per token: [num_heads, HEAD] of K and of V to cache row ``slot`` (block
    # slot // page, offset slot % page; the cache strides give the layout)
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (d[None, :] < HEAD) & (slot >= 0)
    row = (slot // page) * stride_cb + (slot % page) * stride_cs + heads[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t * k_stride_t + heads[:, None] * k_stride_h + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t * v_stride_t + heads[:, None] * v_stride_h + d[None, :], mask=mask, other=0.0)
    k = k.to(tl.float32)
    v = v.to(tl.float32)
    if HAS_SCALE:  # an fp8 cache holds clamp(k / k_scale), rounded to nearest
        k = tl.minimum(tl.maximum(k / tl.load(k_scale_ptr), -limit), limit)
        v = tl.minimum(tl.maximum(v / tl.load(v_scale_ptr), -limit), limit)
    tl.store(kc_ptr + row, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + row, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """k, v [T, nk, hs] (views with a contiguous last dim are fine) into kv_cache
    [2, num_blocks, block_size, nk, hs] (any strides but the last; e.g. a head-major cache seen
    through a transpose) at the flat slots ``slot_mapping`` [T] (block * block_size + offset);
    with an fp8 cache and float32 0-dim ``k_scale``/``v_scale``, stores clamp(k / k_scale)."""
    t = k.shape[0]
    if t == 0:
        return
    nk, hs = kv_cache.shape[-2], kv_cache.shape[-1]
    k = k.view(t, nk, hs) if k.dim() == 2 else k
    v = v.view(t, nk, hs) if v.dim() == 2 else v
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if kv_cache.stride(-1) != 1:
        raise ValueError("store_kv_cache needs a kv_cache [2, num_blocks, block_size, nk, hs] with a contiguous "
                         "last dim")
    block_heads, block_d = next_pow2(nk), next_pow2(hs)
    has_scale = k_scale is not None
    limit = float(torch.finfo(kv_cache.dtype).max) if has_scale else 0.0
    early = pdl(k.device)
    _store_kv_kernel[(t,)](k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), kv_cache[0], kv_cache[1],
                           kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), kv_cache.shape[2],
                           slot_mapping, k_scale if has_scale else slot_mapping, v_scale if has_scale else slot_mapping,
                           limit, nk, HEAD=hs, BLOCK_HEADS=block_heads, BLOCK_D=block_d, HAS_SCALE=has_scale,
                           PDL=early, num_warps=4 if block_heads * block_d <= 4096 else 8, launch_pdl=early)
