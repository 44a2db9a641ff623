"""Grouping (token, expert) pairs by expert for the fused-MoE GEMMs, in one small launch.

The torch version (``pagoda.layers.moe_grouping.group_pairs_by_expert``) takes about a dozen launches (sort,
scatter, cumsum, searchsorted, fills); at decode batch sizes those launches cost more than
the work, once per MoE layer and step. This kernel does it in one program: a histogram of
the expert ids, each expert's run padded to BLOCK_M (a cumulative sum), the expert of every
block, then each pair placed at its expert's next free row with an atomic counter. The
order of pairs inside an expert's run is not fixed; each output row only depends on its
own pair, so results are the same. Sixteen warps, so that each thread places only a few pairs:
with four warps the single program took 21 us per layer at 2,048 pairs on an H200, most likely
in the placement's atomics (each waits for the slot it returns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_cuda._triton import next_pow2


@triton.jit
def _align_kernel(ids_ptr, num_pairs, num_experts, max_blocks, cursor_ptr, pairs_ptr, block_expert_ptr,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_B: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        inside = offs < num_pairs
        e = tl.load(ids_ptr + offs, mask=inside, other=-1).to(tl.int32)
        # ids outside [0, E) (experts of other ranks) and the tail go to the spare last bin
        e = tl.where(inside & (e >= 0) & (e < num_experts), e, E_PAD - 1)
        counts += tl.histogram(e, E_PAD)
    counts = tl.where(experts < num_experts, counts, 0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    tl.store(cursor_ptr + experts, (block_end - blocks) * BLOCK_M)
    slots = max_blocks * BLOCK_M
    for start in range(0, slots, CHUNK):  # padding rows point past the last pair
        offs = start + tl.arange(0, CHUNK)
        tl.store(pairs_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs, mask=offs < slots)
    for b0 in range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        ended = (block_end[None, :] <= b[:, None]) & (experts[None, :] < num_experts)
        tl.store(block_expert_ptr + b, tl.sum(ended.to(tl.int32), axis=1), mask=b < max_blocks)
    tl.debug_barrier()  # the cursors and padding above are visible to every thread below
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        inside = offs < num_pairs
        e = tl.load(ids_ptr + offs, mask=inside, other=-1).to(tl.int32)
        valid = inside & (e >= 0) & (e < num_experts)
        dest = tl.atomic_add(cursor_ptr + tl.where(valid, e, 0), 1, mask=valid)
        tl.store(pairs_ptr + dest, offs, mask=valid)


def align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Same contract as ``pagoda.layers.moe_grouping.group_pairs_by_expert``."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_pairs = flat.numel()
    max_blocks = -(-num_pairs // block_m) + num_experts
    e_pad = next_pow2(num_experts + 1)
    cursor = torch.empty(e_pad, dtype=torch.int32, device=flat.device)
    pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=flat.device)
    _align_kernel[(1,)](flat, num_pairs, num_experts, max_blocks, cursor, pairs, block_expert, BLOCK_M=block_m,
                        E_PAD=e_pad, CHUNK=2048, BLOCK_B=max(16, 8192 // e_pad), num_warps=16)
    return pairs, block_expert, max_blocks
