"""Gemma 2 and Gemma 3 (text) tiny random models against transformers: sliding-window and global
layers alternating (windows shorter than the prompts), soft-capping, query_pre_attn_scalar, the
(1 + w) norms, scaled embeddings, Gemma 3's q/k norms and rope per layer type."""

import pytest
import torch
from pagoda import LLM
from pagoda.testing import (
    assert_greedy_matches,
    assert_kv_bytes_per_token,
    assert_prefix_cache_matches,
    assert_prompt_logits_match,
    assert_weights_consumed,
    make_tiny_checkpoint,
    random_prompts,
)
from transformers import AutoModelForCausalLM

VOCAB = 320
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, head_dim=16, query_pre_attn_scalar=24,
            sliding_window=12)
VARIANTS = {
    # layers sliding, global, sliding; both soft-caps
    "gemma2": ("gemma2", dict(TINY, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma2-nocap": ("gemma2", dict(TINY, num_key_value_heads=4, attn_logit_softcapping=None,
                                    final_logit_softcapping=None)),
    # q/k norms, a global layer between sliding ones, the global rope linearly scaled
    "gemma3": ("gemma3_text", dict(TINY, head_dim=32, layer_types=["sliding_attention", "full_attention",
                                                                   "sliding_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                       "rope_theta": 1e6}})),
}
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    model_type, fields = VARIANTS[request.param]
    path = make_tiny_checkpoint(model_type, tmp_path_factory.mktemp(request.param), seed=2, **fields)
    attn = "eager" if fields.get("attn_logit_softcapping") else None  # transformers' SDPA drops the soft-cap
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=attn).eval()
    return path, hf


def test_prompt_logits_match_transformers(tiny):
    path, hf = tiny
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8)
    # 60 tokens: five times the window
    assert_prompt_logits_match(llm, path, random_prompts(2, VOCAB, 20, 60, seed=3), hf_model=hf, atol=LOGIT_TOL,
                               rtol=LOGIT_TOL)
    assert_kv_bytes_per_token(llm)


def test_greedy_batch_with_chunked_prefill_and_preemption(tiny):
    path, hf = tiny
    prompts = random_prompts(6, VOCAB, 5, 45, seed=7)
    assert_greedy_matches(path, prompts, 32, hf_model=hf, engine=dict(num_kv_blocks=12, block_size=8,
                                                                      max_num_batched_tokens=24, max_model_len=80,
                                                                      enable_prefix_caching=False))


def test_prefix_caching(tiny):
    """A 40-token shared prefix (over three windows) computed once, read from the cache by four prompts."""
    path, hf = tiny
    prefix = random_prompts(1, VOCAB, 40, 40, seed=12)[0]
    assert_prefix_cache_matches(path, prefix, random_prompts(5, VOCAB, 3, 20, seed=13), 16, hf_model=hf)


def test_every_checkpoint_tensor_is_loaded(tiny):
    path, _ = tiny
    assert_weights_consumed(path)


def test_bidirectional_config_is_refused(tmp_path):
    path = make_tiny_checkpoint("gemma3_text", tmp_path, seed=1, **dict(TINY, use_bidirectional_attention=True))
    with pytest.raises(Exception, match="use_bidirectional_attention"):
        LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=8, block_size=8)
