"""The step token budget when ``max_num_batched_tokens`` is unset: the platform's, from the model's cost.

A platform may bound a running stream's stall (the time of one step that also computes prompt chunks)
by giving ``Platform.step_token_budget(flops_per_token)``: the CPU's keeps a step near a second. The
budget then applies to steps while any sequence decodes; a step with no decoding sequence (nobody is
waiting for a token) takes ``default_max_num_batched_tokens()``, so a lone long prompt is not cut into
many small, less efficient chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

# the context at which a token's attention is costed (longer contexts make steps proportionally slower)
COSTED_CONTEXT = 2048


@dataclass
class StepBudget:
    tokens: int  # the budget of a step in which some sequence decodes
    idle_tokens: int | None  # the budget of a step with no decoding sequence (None: ``tokens``)
    reason: str


def flops_per_token(model, context: int = COSTED_CONTEXT) -> float:
    """Matmul FLOPs of one token through ``model`` (MoE: the routed share of the experts), plus its
    attention over ``context`` earlier tokens; the LM head is left out (sampled rows only)."""
    from pagoda.layers.attention import Attention
    from pagoda.layers.linear import LinearBase
    from pagoda.layers.moe import FusedMoE

    total = 0.0
    for m in model.modules():
        if isinstance(m, LinearBase):
            total += 2.0 * m.input_size_per_partition * sum(m.output_partition_sizes)
        elif isinstance(m, FusedMoE):
            share = m.routing.top_k / max(1, m.num_experts)
            total += 2.0 * share * sum(p.numel() for p in m.parameters(recurse=False))
        elif isinstance(m, Attention):
            total += 4.0 * context * m.spec.num_heads * m.spec.head_size
    return total


def choose_step_budget(config, platform, model) -> StepBudget:
    if config.max_num_batched_tokens:
        return StepBudget(config.max_num_batched_tokens, None, "max_num_batched_tokens")
    default = platform.default_max_num_batched_tokens()
    bounded = platform.step_token_budget(flops_per_token(model))
    if bounded is None or bounded >= default:
        return StepBudget(default, None, f"the {platform.name} platform's default")
    return StepBudget(bounded, default, f"a stall bound of the {platform.name} platform, from the model's "
                      f"FLOPs per token")
