"""Llama, Qwen2, Qwen3 and Mistral tiny random models against transformers."""

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.testing import hf_greedy_tokens, hf_prompt_logits, make_tiny_checkpoint, random_prompts

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
    prompt = random_prompts(1, 320, 40, 40, seed=3)[0]
    ours = llm.prompt_logits(prompt)
    ref = hf_prompt_logits(path, prompt)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)


def test_greedy_batch_with_chunked_prefill_and_preemption(tiny):
    _, path = tiny
    prompts = random_prompts(6, 320, 5, 45, seed=7)
    ref = hf_greedy_tokens(path, prompts, 32)
    # 10 blocks of 8 tokens cannot hold six sequences of up to 77 tokens: preemption happens;
    # a 24-token budget splits the longer prompts into chunks.
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=10, block_size=8,
              max_num_batched_tokens=24, max_model_len=80, enable_prefix_caching=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_used"] == 0
