"""Choosing experts: router logits in, (top-k weights, top-k expert ids) out.

Routing is separate from expert compute (``pagoda.layers.moe.FusedMoE``) so that a batch is
routed once, then computed grouped by expert. Two schemes cover the supported models:

- softmax top-k (Qwen2-MoE, Qwen3-MoE, Mixtral): softmax over the experts in float32, the
  ``top_k`` largest, optionally renormalised to sum to 1 (``norm_topk_prob``);
- sigmoid grouped top-k (DeepSeek-V3): sigmoid scores in float32; a per-expert correction
  bias (``e_score_correction_bias``) is added *for choosing only*; experts are split into
  ``num_groups`` groups, each group is scored by the sum of its two best biased scores, the
  ``topk_groups`` best groups are kept and the ``top_k`` best experts chosen among them; the
  weights are the unbiased scores of those experts, optionally renormalised, times
  ``scaling_factor`` (``routed_scaling_factor``).

Both follow HF transformers' routers operation for operation, so the same experts are chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.errors import ModelLoadError
from pagoda.kernels import get_op

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    """How a MoE layer picks ``top_k`` of ``num_experts`` experts for each token."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    num_groups: int = 1  # > 1: grouped top-k (DeepSeek's n_group)
    topk_groups: int = 1  # groups kept per token (DeepSeek's topk_group)
    scaling_factor: float = 1.0  # routed_scaling_factor, applied to the weights

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ModelLoadError(f"MoE scoring {self.scoring!r} is not supported (supported: {', '.join(SCORINGS)})")
        if not 0 < self.top_k <= self.num_experts:
            raise ModelLoadError(f"config num_experts_per_tok={self.top_k} must be between 1 and the number of "
                                 f"experts ({self.num_experts})")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ModelLoadError(f"config n_group={self.num_groups} must divide the number of routed experts "
                                 f"({self.num_experts})")
        if self.num_groups > 1 and not 0 < self.topk_groups <= self.num_groups:
            raise ModelLoadError(f"config topk_group={self.topk_groups} must be between 1 and n_group="
                                 f"{self.num_groups}")
        if self.num_groups > 1 and self.topk_groups * (self.num_experts // self.num_groups) < self.top_k:
            raise ModelLoadError(f"config topk_group={self.topk_groups} groups of {self.num_experts // self.num_groups}"
                                 f" experts cannot supply num_experts_per_tok={self.top_k} experts")

    def select(self, router_logits: torch.Tensor,
               correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] (+ correction_bias [E]) -> (topk_weights [T, K] float32,
        topk_ids [T, K] int64). Grouped selection scores a group by its two best experts
        (DeepSeek-V3)."""
        if self.scoring == "softmax" and self.num_groups == 1 and correction_bias is None:
            return softmax_topk(router_logits, self.top_k, self.renormalize, self.scaling_factor)
        return grouped_topk(router_logits, self.top_k, self.num_groups, self.topk_groups, self.renormalize,
                            self.scoring, correction_bias, self.scaling_factor)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, then the ``top_k`` largest (HF Qwen2MoeTopKRouter), by
    the platform's ``topk_softmax`` op (one launch on CUDA instead of four)."""
    return get_op("topk_softmax")(router_logits, top_k, renormalize, scaling_factor)


def grouped_topk(router_logits: torch.Tensor, top_k: int, num_groups: int, topk_groups: int, renormalize: bool,
                 scoring: str = "sigmoid", correction_bias: torch.Tensor | None = None,
                 scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k (HF DeepseekV3TopkRouter); see the module docstring."""
    logits = router_logits.float()
    scores = logits.sigmoid() if scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores + correction_bias.float() if correction_bias is not None else scores
    t, e = choice.shape
    if num_groups > 1:
        per_group = e // num_groups
        group_scores = choice.view(t, num_groups, per_group).topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]  # [T, topk_groups]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(t, num_groups, per_group).reshape(t, e)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor != 1.0:
        weights = weights * scaling_factor
    return weights, ids
