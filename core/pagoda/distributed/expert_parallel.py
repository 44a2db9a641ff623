"""Which experts one MoE layer computes on this rank, and for which (token, expert) pairs.

Under expert parallelism every rank still holds every token (attention is tensor parallel,
so the hidden states are replicated after each all-reduce) and computes the routing itself:
the router is replicated and deterministic, so all ranks pick the same experts without
exchanging anything — routing is computed once per layer and step, not per expert shard.
Dispatch is then local: a rank keeps the (token, expert) pairs whose expert it holds and
maps the rest to -1 (which ``fused_moe`` skips); the combine is the all-reduce of the
layer's output, the same one tensor parallelism already does. An all-to-all dispatch would
only pay off with data-parallel attention (tokens not replicated); here it would move more
bytes than the all-reduce and need host-known split sizes, which rules out graph capture.

An expert held by several ranks (a replica placed by ``expert_placement``) has its pairs
split between the replicas by token position: pair (t, k) goes to replica ``t % replicas``,
so every rank agrees on the owner without communicating.
"""

from __future__ import annotations

import torch

from pagoda.distributed.expert_placement import ExpertPlacement, contiguous_holders
from pagoda.distributed.parallel_state import expert_parallel_enabled, get_expert_placement, get_tp_rank, get_tp_size


class ExpertShard:
    """``local_experts``: the global ids of the experts this rank holds, in slot order (the
    order of the layer's stacked weight tensors)."""

    def __init__(self, num_experts: int, holders: list[list[int]] | None = None, rank: int = 0):
        self.num_experts = num_experts
        self.enabled = holders is not None
        holders = holders if holders is not None else [list(range(num_experts))]
        self.rank = rank
        self.local_experts: list[int] = list(holders[rank])
        self._slot = {e: i for i, e in enumerate(self.local_experts)}
        # replica r of expert e: (rank, slot); this rank's table says which replicas are its own
        owners: list[list[tuple[int, int]]] = [[] for _ in range(num_experts)]
        for r, ids in enumerate(holders):
            for slot, e in enumerate(ids):
                owners[e].append((r, slot))
        self.max_replicas = max(len(o) for o in owners) if owners else 1
        self._counts = [len(o) for o in owners]
        self._table = [[slot if r == rank else -1 for r, slot in o] + [-1] * (self.max_replicas - len(o))
                       for o in owners]
        self._device_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def for_layer(cls, prefix: str, num_experts: int) -> ExpertShard:
        """This rank's shard of the layer ``prefix`` under the current parallel state."""
        if not expert_parallel_enabled():
            return cls(num_experts)
        size = get_tp_size()
        placement: ExpertPlacement | None = get_expert_placement()
        holders = placement.holders(prefix, num_experts) if placement is not None \
            else contiguous_holders(num_experts, size)
        return cls(num_experts, holders, get_tp_rank())

    @property
    def num_local(self) -> int:
        return len(self.local_experts)

    def slot_of(self, expert_id: int) -> int | None:
        """The local slot holding global expert ``expert_id``, None if another rank holds it."""
        return self._slot.get(expert_id)

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        tables = self._device_tables.get(device)
        if tables is None:
            tables = (torch.tensor(self._table, dtype=torch.long, device=device),
                      torch.tensor(self._counts, dtype=torch.long, device=device))
            self._device_tables[device] = tables
        return tables

    def local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """topk_ids [T, K] global expert ids -> local slots, -1 where another rank computes the pair."""
        if not self.enabled:
            return topk_ids
        table, counts = self._tables(topk_ids.device)
        ids = topk_ids.long()
        if self.max_replicas == 1:
            return table[ids, 0]
        token = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
        return table[ids, token % counts[ids]]

    def describe(self) -> str:
        if not self.enabled:
            return f"all {self.num_experts} experts"
        return f"{self.num_local} of {self.num_experts} experts (rank {self.rank})"
