"""(token, expert) pairs grouped by expert, for kernels that run one GEMM per block of an
expert's rows (the fused-MoE kernels of pagoda-cuda and pagoda-quant).

``group_pairs_by_expert(topk_ids [T, K], E, block_m)`` numbers the pairs ``t * K + k`` and sorts
them by expert, stably (pairs keep their order inside an expert's run). Each expert's run is
padded to a multiple of ``block_m`` rows, so every block of ``block_m`` rows belongs to one
expert. Ids outside [0, E) (experts held by other expert-parallel ranks) get no row. Returns

- pairs [max_blocks * block_m] int32: the pair id of each row; padding rows hold T * K;
- block_expert [max_blocks] int32: the expert of each block, E for blocks past the last run;
- max_blocks = ceil(T * K / block_m) + E, the most blocks any routing can need.

Device work only (no host synchronisation), so it can be captured in a graph. Torch ops
(about a dozen launches); pagoda-cuda has a one-launch Triton version for decode sizes.
"""

from __future__ import annotations

import torch


def group_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int,
                          block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    max_blocks = -(-num_pairs // block_m) + num_experts
    key = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    blocks = (counts + block_m - 1) // block_m
    blocks[num_experts:].zero_()  # invalid pairs get no block (a device fill: graph-capturable)
    block_end = torch.cumsum(blocks, 0)
    block_start = block_end - blocks
    order = torch.argsort(key, stable=True)
    sorted_key = key.index_select(0, order)
    run_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - run_start.index_select(0, sorted_key)
    dest = block_start.index_select(0, sorted_key) * block_m + rank
    dummy = max_blocks * block_m  # invalid pairs land in one extra slot, cut off below
    dest = torch.where(sorted_key < num_experts, dest, torch.full_like(dest, dummy))
    pairs = torch.full((dummy + 1,), num_pairs, dtype=torch.int32, device=device)
    pairs.scatter_(0, dest, order.to(torch.int32))
    block_ids = torch.arange(max_blocks, device=device)
    block_expert = torch.searchsorted(block_end[:num_experts].contiguous(), block_ids, right=True).to(torch.int32)
    return pairs[:dummy], block_expert, max_blocks
