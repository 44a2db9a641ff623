"""Write each new token's K and V into the paged cache at its slot (slots < 0 are padding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_cuda._triton import next_pow2


@triton.jit
def _store_kv_kernel(k_ptr, k_stride_t, k_stride_h, v_ptr, v_stride_t, v_stride_h, kc_ptr, vc_ptr,
                     slot_ptr, num_heads,
                     HEAD: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program per token: [num_heads, HEAD] of K and of V to cache row ``slot``
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (d[None, :] < HEAD) & (slot >= 0)
    row = slot * num_heads * HEAD + heads[:, None] * HEAD + d[None, :]
    k = tl.load(k_ptr + t * k_stride_t + heads[:, None] * k_stride_h + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t * v_stride_t + heads[:, None] * v_stride_h + d[None, :], mask=mask, other=0.0)
    tl.store(kc_ptr + row, k.to(tl.float32).to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + row, v.to(tl.float32).to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, nk, hs] (views with a contiguous last dim are fine) into kv_cache
    [2, num_blocks, block_size, nk, hs] at the flat slots ``slot_mapping`` [T]."""
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
    if not kv_cache.is_contiguous():
        raise ValueError("store_kv_cache needs a contiguous kv_cache [2, num_blocks, block_size, nk, hs]")
    block_heads, block_d = next_pow2(nk), next_pow2(hs)
    _store_kv_kernel[(t,)](k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), kv_cache[0], kv_cache[1],
                           slot_mapping, nk, HEAD=hs, BLOCK_HEADS=block_heads, BLOCK_D=block_d,
                           num_warps=4 if block_heads * block_d <= 4096 else 8)
