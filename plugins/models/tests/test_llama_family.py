"""Llama, Qwen2, Qwen3 and Mistral tiny random models against transformers."""

import pytest
from pagoda import LLM
from pagoda.testing import (
    assert_greedy_matches,
    assert_kv_bytes_per_token,
    assert_prompt_logits_match,
    assert_weights_consumed,
    make_tiny_checkpoint,
    random_prompts,
)

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
VARIANTS = {
    "llama": dict(TINY),
    "llama-bias-nogqa": dict(TINY, attention_bias=True, num_key_value_heads=4, tie_word_embeddings=True),
    "qwen2": dict(TINY),
    "qwen3": dict(TINY, head_dim=32),
    "mistral": dict(TINY, sliding_window=24),
}
MODEL_TYPE = {"llama-bias-nogqa": "llama"}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    name = request.param
    path = make_tiny_checkpoint(MODEL_TYPE.get(name, name), tmp_path_factory.mktemp(name), seed=1,
                                **VARIANTS[name])
    return name, path


def test_prompt_logits_match_transformers(tiny):
    _, path = tiny
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8)
    assert_prompt_logits_match(llm, path, random_prompts(1, 320, 40, 40, seed=3), atol=2e-4, rtol=2e-4)
    assert_kv_bytes_per_token(llm)  # 2 layers x K and V x KV heads x head_dim x 4 bytes


def test_greedy_batch_with_chunked_prefill_and_preemption(tiny):
    """Same tokens as transformers' generate; also asserts that a sequence was preempted,
    that the longest prompts were chunked and that every KV block was freed."""
    _, path = tiny
    prompts = random_prompts(6, 320, 5, 45, seed=7)
    # 10 blocks of 8 tokens cannot hold six sequences of up to 77 tokens: preemption happens;
    # a 24-token budget splits the longer prompts into chunks.
    assert_greedy_matches(path, prompts, 32, engine=dict(num_kv_blocks=10, block_size=8, max_num_batched_tokens=24,
                                                         max_model_len=80, enable_prefix_caching=False))


def test_every_checkpoint_tensor_is_loaded(tiny):
    _, path = tiny
    assert_weights_consumed(path)

