"""Synthetic mixed batches over random paged caches, for backend checks (tests and the hardware check).

A batch holds decodes first (one new token each), then prefill chunks, some continuing a
cached context and some starting fresh, with block tables that scatter blocks over the cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from pagoda.forward_context import AttentionMetadata


@dataclass
class MixedBatch:
    meta: AttentionMetadata
    cached_lens: list[int]  # tokens already in the cache before this step, per sequence
    new_lens: list[int]  # new tokens of this step, per sequence


def mixed_batch(decode_lens: list[int], prefills: list[tuple[int, int]], block_size: int,
                num_blocks: int, seed: int = 0) -> MixedBatch:
    """decode_lens: total length of each decode sequence (its last token is new);
    prefills: (cached context, new tokens) per prefill chunk."""
    rng = random.Random(seed)
    cached = [n - 1 for n in decode_lens] + [c for c, _ in prefills]
    new = [1] * len(decode_lens) + [q for _, q in prefills]
    totals = [c + q for c, q in zip(cached, new)]
    free = list(range(1, num_blocks))  # block 0 stays unused, like a padding entry
    rng.shuffle(free)
    tables = []
    for total in totals:
        need = -(-total // block_size)
        tables.append([free.pop() for _ in range(need)])
    width = max(len(t) for t in tables)
    table_tensor = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table_tensor[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    qsl = [0]
    slots = []
    for i, (c, q) in enumerate(zip(cached, new)):
        qsl.append(qsl[-1] + q)
        for pos in range(c, c + q):
            slots.append(tables[i][pos // block_size] * block_size + pos % block_size)
    meta = AttentionMetadata(
        num_tokens=qsl[-1], num_seqs=len(totals), num_decodes=len(decode_lens), max_query_len=max(new),
        max_seq_len=max(totals), block_size=block_size,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(totals, dtype=torch.int32),
        block_tables=table_tensor, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=qsl, seq_lens_cpu=totals)
    return MixedBatch(meta, cached, new)


def context_slots(batch: MixedBatch) -> torch.Tensor:
    """The cache slots of every sequence's already-cached tokens (filled before the step)."""
    meta, bs = batch.meta, batch.meta.block_size
    slots = []
    for i, c in enumerate(batch.cached_lens):
        for pos in range(c):
            slots.append(int(meta.block_tables[i, pos // bs]) * bs + pos % bs)
    return torch.tensor(slots, dtype=torch.int64)


def metadata_on(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """A copy of ``meta`` whose tensors live on ``device`` (host lists unchanged)."""
    from dataclasses import replace

    return replace(meta, query_start_loc=meta.query_start_loc.to(device), seq_lens=meta.seq_lens.to(device),
                   block_tables=meta.block_tables.to(device), slot_mapping=meta.slot_mapping.to(device))
