"""The MLU's paged KV cache layout and its torch reference ops.

Cambricon's paged kernels (torch_mlu_ops ``reshape_paged_cache``, ``single_query_cached_kv_attn``,
``flash_attention`` with block tables) take caches shaped [num_blocks, num_kv_heads, block_size,
head_size]: heads outside, tokens of a block inside. The MLU backends keep one tensor per layer,
[2, num_blocks, num_kv_heads, block_size, head_size] (K then V), so those kernels read it as is.
"""

from __future__ import annotations

import torch

STORE_OP = "store_kv_cache_head_major"  # kernel op name: torch reference here, torch_mlu_ops on the MLU


def head_major_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
    return (2, num_blocks, num_kv_heads, block_size, head_size)


def store_kv_cache_head_major(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None) -> None:
    """Write k, v [T, nk, hs] into kv_cache [2, num_blocks, nk, block_size, hs] at the flat slots
    ``slot_mapping`` [T] (block * block_size + offset); slots < 0 are skipped (padding).
    With ``k_scale``/``v_scale`` (an fp8 cache, as the core's ``store_kv_cache``) it stores
    ``clamp(k / k_scale)`` to the cache type's range; readers multiply by the scale."""
    if k_scale is not None:
        limit = torch.finfo(kv_cache.dtype).max
        k = (k.float() / k_scale).clamp(-limit, limit)
        v = (v.float() / v_scale).clamp(-limit, limit)
    block_size = kv_cache.shape[3]
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_dst, v_dst, k, v = kv_cache[0], kv_cache[1], k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if kv_cache.dtype.itemsize == 1 and kv_cache.dtype.is_floating_point:  # write fp8 as bytes
        k_dst, v_dst, k, v = (t.view(torch.uint8) for t in (k_dst, v_dst, k, v))
    # Two index tensors around a full slice: the indexed view is [T, nk, hs], like k.
    k_dst[blocks, :, offsets] = k
    v_dst[blocks, :, offsets] = v


def gather_tokens(cache: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Tokens at ``positions`` [B, n] of each sequence from one head-major cache half
    [num_blocks, nk, block_size, hs] through ``block_tables`` [B, W] -> [B, n, nk, hs].
    Positions past the table are clamped to its last slot; callers mask them."""
    block_size = cache.shape[2]
    positions = positions.clamp(0, block_tables.shape[1] * block_size - 1)
    blocks = block_tables.long().gather(1, positions // block_size)
    return cache[blocks, :, positions % block_size]
