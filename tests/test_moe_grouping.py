"""pagoda.layers.moe_grouping: the pairs of each expert in order, padded to whole blocks, ids of
other ranks' experts dropped, and the expert of every block (E past the last run)."""

import pytest
import torch
from pagoda.layers.moe_grouping import group_pairs_by_expert


@pytest.mark.parametrize("tokens,topk,experts,block_m", [(7, 2, 4, 4), (40, 3, 6, 8), (1, 8, 16, 16), (64, 8, 8, 1)])
def test_pairs_grouped_by_expert_in_whole_blocks(tokens, topk, experts, block_m):
    gen = torch.Generator().manual_seed(tokens * experts)
    ids = torch.randint(-1, experts + 1, (tokens, topk), generator=gen)  # -1 and E: experts of other ranks
    pairs, block_expert, max_blocks = group_pairs_by_expert(ids, experts, block_m)
    num_pairs = tokens * topk
    assert max_blocks == -(-num_pairs // block_m) + experts
    assert pairs.shape == (max_blocks * block_m,) and pairs.dtype == block_expert.dtype == torch.int32
    flat = ids.flatten().tolist()
    rows = pairs.view(max_blocks, block_m).tolist()
    block = 0
    for e in range(experts):
        mine = [p for p, x in enumerate(flat) if x == e]
        nblocks = -(-len(mine) // block_m)
        assert block_expert[block:block + nblocks].tolist() == [e] * nblocks
        got = [p for row in rows[block:block + nblocks] for p in row]
        assert got == mine + [num_pairs] * (nblocks * block_m - len(mine))  # stable order, filler after
        block += nblocks
    assert block_expert[block:].tolist() == [experts] * (max_blocks - block)
    assert all(p == num_pairs for row in rows[block:] for p in row)
