"""Helpers to check a pagoda model against HF transformers (used by pagoda's own tests and by
plugin authors): tiny random checkpoints, HF reference outputs, and the comparisons."""

from pagoda.testing.reference import (
    hf_expert_counts,
    hf_greedy_tokens,
    hf_prompt_logits,
    make_tiny_checkpoint,
    random_prompts,
)

__all__ = ["hf_expert_counts", "hf_greedy_tokens", "hf_prompt_logits", "make_tiny_checkpoint", "random_prompts"]
