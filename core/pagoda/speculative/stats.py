"""Counts of drafted and accepted tokens (``LLM.get_stats()["speculative"]``, ``/metrics``, ``pagoda bench``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculativeStats:
    num_speculative_tokens: int
    num_drafts: int = 0  # verifications (one per sequence and step that had drafted tokens)
    draft_tokens: int = 0  # drafted tokens the target verified
    accepted_tokens: int = 0  # of those, kept
    drafted_at: list[int] = field(default_factory=list)  # per draft position: how often a token was drafted there
    accepted_at: list[int] = field(default_factory=list)  # ... and kept

    def __post_init__(self) -> None:
        self.drafted_at = [0] * self.num_speculative_tokens
        self.accepted_at = [0] * self.num_speculative_tokens

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One sequence's verification: ``num_drafted`` tokens proposed, the first ``num_accepted`` kept."""
        self.num_drafts += 1
        self.draft_tokens += num_drafted
        self.accepted_tokens += num_accepted
        for i in range(num_drafted):
            self.drafted_at[i] += 1
        for i in range(num_accepted):
            self.accepted_at[i] += 1

    def as_dict(self) -> dict:
        """acceptance_rate: accepted / drafted; mean_accepted_length: tokens a verification yields (the
        accepted drafts plus the target's own token, as vLLM counts it); per_position_acceptance: the
        share of tokens drafted at position i that were kept."""
        return {
            "num_drafts": self.num_drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "mean_accepted_length": 1 + self.accepted_tokens / self.num_drafts if self.num_drafts else 0.0,
            "per_position_acceptance": [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
        }


def speculative_lines(stats: dict | None) -> list[str]:
    """The ``pagoda bench`` output line of an engine's speculative stats (none without speculation)."""
    if not stats:
        return []
    per = " ".join(f"{a:.2f}" for a in stats["per_position_acceptance"])
    return [f"  speculative      {stats['accepted_tokens']:,} of {stats['draft_tokens']:,} drafted tokens accepted "
            f"({100 * stats['acceptance_rate']:.1f}%), {stats['mean_accepted_length']:.2f} tokens per "
            f"verification; by position {per}"]


def repeated_prompts(prompts: list[list[int]], period: int) -> list[list[int]]:
    """Each prompt's first ``period`` tokens repeated to its length (a benchmark workload where
    prompt lookup finds drafts)."""
    if period <= 0:
        raise ValueError("--prompt-period must be positive")
    return [[p[i % period] for i in range(len(p))] for p in prompts]
