"""Helpers to check a pagoda model against HF transformers, used by pagoda's own tests and by
plugin authors: tiny random checkpoints, transformers reference outputs, the conformance
checks of ``pagoda check-model`` (as ``check_*`` functions returning a ``CheckResult`` and as
``assert_*`` pytest helpers) and ``check_model`` itself."""

from pagoda.testing.conformance import (
    CheckResult,
    assert_greedy_matches,
    assert_kv_bytes_per_token,
    assert_prefix_cache_matches,
    assert_prompt_logits_match,
    assert_weights_consumed,
    check_greedy,
    check_kv_cache,
    check_prefix_cache,
    check_prompt_logits,
    check_weights,
    stress_settings,
)
from pagoda.testing.harness import ConformanceReport, check_model
from pagoda.testing.reference import (
    cut_at_stops,
    hf_expert_counts,
    hf_greedy_tokens,
    hf_prompt_logits,
    load_reference_model,
    make_tiny_checkpoint,
    random_prompts,
    set_eos_token,
)
from pagoda.testing.tiny import expected_kv_bytes_per_token, variants_for_architecture

__all__ = [
    "CheckResult", "ConformanceReport", "assert_greedy_matches", "assert_kv_bytes_per_token",
    "assert_prefix_cache_matches", "assert_prompt_logits_match", "assert_weights_consumed", "check_greedy",
    "check_kv_cache", "check_model", "check_prefix_cache", "check_prompt_logits", "check_weights", "cut_at_stops",
    "expected_kv_bytes_per_token", "hf_expert_counts", "hf_greedy_tokens", "hf_prompt_logits",
    "load_reference_model", "make_tiny_checkpoint", "random_prompts", "set_eos_token", "stress_settings",
    "variants_for_architecture",
]
