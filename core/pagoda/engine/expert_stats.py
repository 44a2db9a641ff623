"""Per-expert token counts of MoE layers, summarised as a load-balance figure."""

from __future__ import annotations

import torch


def expert_load_summary(counts: dict[str, torch.Tensor]) -> dict | None:
    """{"layers": {prefix: [count per expert]}, "total": [...], "max_over_mean": x,
    "active_share": share of experts that received any token} or None without MoE layers."""
    if not counts:
        return None
    layers = {name: c.detach().to("cpu", torch.long).tolist() for name, c in sorted(counts.items())}
    width = max(len(v) for v in layers.values())
    total = [0] * width
    for values in layers.values():
        for i, v in enumerate(values):
            total[i] += v
    per_layer = []
    for values in layers.values():
        mean = sum(values) / len(values)
        if mean > 0:
            per_layer.append(max(values) / mean)
    active = sum(1 for values in layers.values() for v in values if v > 0)
    slots = sum(len(values) for values in layers.values())
    return {
        "layers": layers,
        "total": total,
        "max_over_mean": sum(per_layer) / len(per_layer) if per_layer else 0.0,
        "active_share": active / slots if slots else 0.0,
    }
