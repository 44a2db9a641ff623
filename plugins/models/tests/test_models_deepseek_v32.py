"""DeepSeek-V3.2 (DeepSeek Sparse Attention) tiny random models against transformers: the indexer's
top-k smaller than the prompts, so each query attends to a subset of its tokens."""

import json

import pytest
import torch
from pagoda import LLM
from pagoda.testing import (
    assert_greedy_matches,
    assert_kv_bytes_per_token,
    assert_prefix_cache_matches,
    assert_prompt_logits_match,
    assert_weights_consumed,
    hf_prompt_logits,
    make_tiny_checkpoint,
    random_prompts,
)
from transformers import AutoModelForCausalLM

VOCAB = 320
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            n_shared_experts=1, first_k_dense_replace=1, index_topk=8, index_head_dim=16, index_n_heads=8,
            max_position_embeddings=256)
VARIANTS = {
    "top8": dict(TINY),
    # YaRN (the indexer's rotary takes its attention factor too) and a wider top-k
    "top12-yarn": dict(TINY, index_topk=12, rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                                                               original_max_position_embeddings=32, beta_fast=32,
                                                               beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
}
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    path = make_tiny_checkpoint("deepseek_v32", tmp_path_factory.mktemp(request.param), seed=2,
                                **VARIANTS[request.param])
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, hf


def test_prompt_logits_match_transformers(tiny):
    path, hf = tiny
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8)
    assert_prompt_logits_match(llm, path, random_prompts(2, VOCAB, 20, 60, seed=3), hf_model=hf, atol=LOGIT_TOL,
                               rtol=LOGIT_TOL)
    # every layer caches kv_lora_rank + qk_rope_head_dim + index_head_dim values per token
    assert_kv_bytes_per_token(llm, 2 * (16 + 8 + 16) * 4)


def test_greedy_batch_with_chunked_prefill_and_preemption(tiny):
    path, hf = tiny
    assert_greedy_matches(path, random_prompts(6, VOCAB, 5, 45, seed=7), 32, hf_model=hf,
                          engine=dict(num_kv_blocks=10, block_size=8, max_num_batched_tokens=24, max_model_len=80,
                                      enable_prefix_caching=False))


def test_prefix_caching(tiny):
    path, hf = tiny
    prefix = random_prompts(1, VOCAB, 40, 40, seed=12)[0]
    assert_prefix_cache_matches(path, prefix, random_prompts(4, VOCAB, 3, 20, seed=13), 12, hf_model=hf)


def test_every_checkpoint_tensor_is_loaded(tiny):
    path, _ = tiny
    assert_weights_consumed(path)


def test_the_selection_matters(tmp_path):
    """With a top-8 the logits of long prompts differ from dense attention's (a larger top-k, the
    same weights): the tests above compare a sparse computation, not a dense one."""
    sparse = make_tiny_checkpoint("deepseek_v32", tmp_path / "sparse", seed=2, **TINY)
    dense = tmp_path / "dense"
    dense.mkdir()
    for f in sparse.iterdir():
        (dense / f.name).write_bytes(f.read_bytes())
    config = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps(dict(config, index_topk=1024)))
    prompt = random_prompts(1, VOCAB, 40, 40, seed=5)[0]
    want_sparse, want_dense = hf_prompt_logits(sparse, prompt), hf_prompt_logits(dense, prompt)
    assert (want_sparse[20:] - want_dense[20:]).abs().max() > 1e-2
    torch.testing.assert_close(want_sparse[:8], want_dense[:8], atol=1e-5, rtol=1e-5)  # <= 8 tokens: all kept
    llm = LLM(model=str(sparse), device="cpu", dtype="float32", num_kv_blocks=16, block_size=8, max_model_len=64)
    torch.testing.assert_close(llm.prompt_logits(prompt), want_sparse, atol=LOGIT_TOL, rtol=LOGIT_TOL)
