"""Where MoE experts live under expert parallelism, and how evenly that spreads the work.

A placement lists, for each MoE layer (by its module prefix, e.g.
``model.layers.3.mlp.experts``), the expert ids every rank holds: ``[[ids of rank 0], [ids of
rank 1], ...]``. An expert may be held by several ranks (a replica of a hot expert); the
tokens routed to it are then split between its replicas. The default placement gives each
rank an equal contiguous block.

``balanced_placement`` builds a placement from per-expert token counts (what
``LLM.get_stats()["expert_load"]["layers"]`` reports): it gives the extra slots
(``redundant_per_rank`` per rank) to the experts with the highest load per replica, then
places the replicas heaviest first on the least loaded rank that has a free slot and does
not hold that expert yet (longest-processing-time first), so the busiest rank carries as
little as possible. ``imbalance`` is the figure to compare: the busiest rank's load over
the mean rank load (1.0 is perfect).

File format (``expert_placement: FILE`` in the engine config), JSON::

    {"num_ranks": 2, "layers": {"model.layers.1.mlp.experts": [[0, 3, 5], [1, 2, 4, 5]], ...}}

A layer the file does not list keeps the contiguous placement.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field
from pathlib import Path

from pagoda.errors import ConfigError


def contiguous_holders(num_experts: int, num_ranks: int) -> list[list[int]]:
    """Equal contiguous blocks (the first ``num_experts % num_ranks`` ranks hold one more)."""
    base, extra = divmod(num_experts, num_ranks)
    holders, start = [], 0
    for r in range(num_ranks):
        size = base + (1 if r < extra else 0)
        holders.append(list(range(start, start + size)))
        start += size
    return holders


def check_holders(holders: list[list[int]], num_experts: int, num_ranks: int, where: str) -> None:
    """Every expert on at least one rank, ids in range, no rank holding one twice."""
    if len(holders) != num_ranks:
        raise ConfigError(f"{where}: places experts on {len(holders)} ranks but the run has {num_ranks} "
                          f"(tensor_parallel_size)")
    seen: set[int] = set()
    for r, ids in enumerate(holders):
        if not isinstance(ids, list) or not all(isinstance(e, int) for e in ids):
            raise ConfigError(f"{where}: rank {r} must hold a list of expert ids, got {ids!r}")
        bad = [e for e in ids if not 0 <= e < num_experts]
        if bad:
            raise ConfigError(f"{where}: rank {r} holds expert ids {bad} outside [0, {num_experts})")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"{where}: rank {r} holds an expert twice ({sorted(ids)})")
        if not ids:
            raise ConfigError(f"{where}: rank {r} holds no expert")
        seen.update(ids)
    missing = sorted(set(range(num_experts)) - seen)
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise ConfigError(f"{where}: experts {shown} are held by no rank")


@dataclass
class ExpertPlacement:
    num_ranks: int
    layers: dict[str, list[list[int]]] = field(default_factory=dict)
    source: str = "expert placement"  # where it came from, for messages

    def holders(self, prefix: str, num_experts: int) -> list[list[int]]:
        """The expert ids of every rank for the MoE layer ``prefix`` (validated)."""
        holders = self.layers.get(prefix)
        if holders is None:
            return contiguous_holders(num_experts, self.num_ranks)
        check_holders(holders, num_experts, self.num_ranks, f"{self.source}: layer {prefix!r}")
        return holders

    def to_json(self) -> dict:
        return {"num_ranks": self.num_ranks, "layers": self.layers}

    def save(self, path: str | Path) -> None:
        """JSON with one line per layer."""
        layers = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in self.layers.items())
        Path(path).write_text(f'{{\n "num_ranks": {self.num_ranks},\n "layers": {{\n{layers}\n }}\n}}\n')

    @classmethod
    def load(cls, path: str | Path) -> ExpertPlacement:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"expert_placement: file {p} does not exist")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"expert_placement: {p} is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("num_ranks"), int) \
                or not isinstance(data.get("layers"), dict):
            raise ConfigError(f"expert_placement: {p} must hold {{\"num_ranks\": N, \"layers\": "
                              f"{{prefix: [[expert ids of rank 0], ...]}}}}")
        return cls(data["num_ranks"], data["layers"], source=f"expert_placement {p}")


# ---------------------------------------------------------------------------- load figures
def rank_loads(counts: list[float], holders: list[list[int]]) -> list[float]:
    """Tokens each rank computes when expert e's ``counts[e]`` tokens are split evenly
    between the ranks holding it."""
    replicas = [0] * len(counts)
    for ids in holders:
        for e in ids:
            replicas[e] += 1
    return [sum(counts[e] / replicas[e] for e in ids) for ids in holders]


def imbalance(counts: list[float], holders: list[list[int]]) -> float:
    """Busiest rank's load over the mean rank load (1.0: perfectly even; 0.0 without load)."""
    loads = rank_loads(counts, holders)
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 0.0


def balanced_holders(counts: list[float], num_ranks: int, redundant_per_rank: int = 1) -> list[list[int]]:
    """Replicate the hottest experts into ``redundant_per_rank`` extra slots per rank, then
    pack replicas heaviest first onto the least loaded rank (see the module docstring)."""
    num_experts = len(counts)
    slots = -(-num_experts // num_ranks) + max(0, redundant_per_rank)
    total = min(slots * num_ranks, num_experts * num_ranks)  # at most one replica per rank
    replicas = [1] * num_experts
    # max-heap of load per replica: the next extra slot goes to the expert that gains most
    heap = [(-counts[e], e) for e in range(num_experts)]
    heapq.heapify(heap)
    for _ in range(total - num_experts):
        while heap:
            _, e = heapq.heappop(heap)
            if replicas[e] < num_ranks:
                break
        else:
            break
        replicas[e] += 1
        if replicas[e] < num_ranks:
            heapq.heappush(heap, (-counts[e] / replicas[e], e))
    pieces = sorted(((counts[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e])),
                    key=lambda p: (-p[0], p[1]))
    holders: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0.0] * num_ranks
    for load, e in pieces:
        options = [r for r in range(num_ranks) if len(holders[r]) < slots and e not in holders[r]]
        if not options:  # uneven slot use: any rank without this expert
            options = [r for r in range(num_ranks) if e not in holders[r]]
        r = min(options, key=lambda r: (loads[r], len(holders[r]), r))
        holders[r].append(e)
        loads[r] += load
    return [sorted(ids) for ids in holders]


def balanced_placement(layer_counts: dict[str, list[float]], num_ranks: int,
                       redundant_per_rank: int = 1) -> ExpertPlacement:
    """A placement for every layer of ``layer_counts`` ({prefix: tokens per expert})."""
    if num_ranks < 1:
        raise ConfigError(f"expert placement needs at least one rank, got {num_ranks}")
    layers = {}
    for prefix, counts in layer_counts.items():
        if sum(counts) > 0:
            layers[prefix] = balanced_holders(list(counts), num_ranks, redundant_per_rank)
    return ExpertPlacement(num_ranks, layers, source="balanced placement")


def placement_report(layer_counts: dict[str, list[float]], num_ranks: int,
                     balanced: ExpertPlacement, current: ExpertPlacement | None = None) -> dict:
    """Mean over layers of the imbalance under ``current`` (default: contiguous) and under
    ``balanced``: {"before": x, "after": y, "layers": n, "ranks": r, "slots_per_rank": s}."""
    before, after = [], []
    current = current or ExpertPlacement(num_ranks)
    slots = 0
    for prefix, counts in layer_counts.items():
        if sum(counts) <= 0:
            continue
        before.append(imbalance(counts, current.holders(prefix, len(counts))))
        holders = balanced.holders(prefix, len(counts))
        after.append(imbalance(counts, holders))
        slots = max(slots, max(len(ids) for ids in holders))
    n = len(before)
    return {"before": sum(before) / n if n else 0.0, "after": sum(after) / n if n else 0.0,
            "layers": n, "ranks": num_ranks, "slots_per_rank": slots}


# extra expert slots per rank that ``pagoda bench`` gives the balanced placement it reports
BENCH_REDUNDANT_PER_RANK = 1


def expert_balance(layer_counts: dict[str, list[float]] | None, config, save_to: str | None = None) -> dict | None:
    """For ``pagoda bench`` under expert parallelism: the busiest rank's load over the mean
    with the run's placement ("before") and with a balanced placement computed from the
    run's own counts ("after"); ``save_to`` writes that placement for ``expert_placement``."""
    if not layer_counts or not config.enable_expert_parallel or config.tensor_parallel_size < 2:
        return None
    ranks = config.tensor_parallel_size
    current = ExpertPlacement.load(config.expert_placement) if config.expert_placement else None
    balanced = balanced_placement(layer_counts, ranks, BENCH_REDUNDANT_PER_RANK)
    report = placement_report(layer_counts, ranks, balanced, current)
    report["current"] = config.expert_placement or "contiguous"
    report["redundant_per_rank"] = BENCH_REDUNDANT_PER_RANK
    if save_to:
        balanced.save(save_to)
        report["saved_to"] = str(save_to)
    return report
