"""Phi-3 against transformers: fused projections, LongRoPE on and off (both config spellings),
sliding window."""

import json
import shutil

import pytest
import torch
from pagoda import LLM
from pagoda.errors import ModelLoadError
from pagoda.testing import (
    assert_greedy_matches,
    assert_kv_bytes_per_token,
    assert_prompt_logits_match,
    assert_weights_consumed,
    hf_greedy_tokens,
    make_tiny_checkpoint,
    random_prompts,
)
from transformers import AutoModelForCausalLM

VOCAB = 320
ORIGINAL = 48  # original_max_position_embeddings of the LongRoPE variants
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=160, pad_token_id=0, bos_token_id=2, eos_token_id=1)
FACTORS = dict(short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[1.0 + 0.7 * i for i in range(8)])
LONGROPE = dict(TINY, original_max_position_embeddings=ORIGINAL,
                rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, **FACTORS))
VARIANTS = {
    "phi3": dict(TINY),
    "phi3-window": dict(TINY, sliding_window=20),
    "phi3-longrope": LONGROPE,
    "phi3-longrope-hub-config": LONGROPE,  # config.json rewritten with rope_scaling + rope_theta below
}
LOGIT_TOL = 1e-4  # float32, absolute and relative; observed differences are ~1e-6


def _hub_style_config(path):
    """Rewrite config.json as hub Phi-3 checkpoints spell it (Phi-3-mini-128k-instruct):
    ``rope_scaling`` {type: longrope, ...} + top-level ``rope_theta``, no ``rope_parameters``."""
    config = json.loads((path / "config.json").read_text())
    del config["rope_parameters"]
    config["rope_scaling"] = dict(type="longrope", **FACTORS)
    config["rope_theta"] = 5000.0
    (path / "config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    path = make_tiny_checkpoint("phi3", tmp_path_factory.mktemp(request.param), seed=3, **VARIANTS[request.param])
    if request.param.endswith("hub-config"):
        _hub_style_config(path)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if request.param.endswith("hub-config"):
        assert hf.config.rope_parameters["rope_type"] == "longrope"
        assert hf.config.rope_parameters["rope_theta"] == 5000.0
    return request.param, path, hf


def test_fused_checkpoint_tensors(tiny):
    _, path, _ = tiny
    names = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]) \
        if (path / "model.safetensors.index.json").exists() else None
    if names is None:
        from safetensors import safe_open

        names = set(safe_open(str(path / "model.safetensors"), "pt").keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names


def test_prompt_logits_match_transformers(tiny):
    name, path, hf = tiny
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=32, block_size=8)
    # with LongRoPE: one prompt within original_max_position_embeddings, one beyond it
    prompts = [random_prompts(1, VOCAB, length, length, seed=length)[0] for length in (40, 60)]
    assert_prompt_logits_match(llm, path, prompts, hf_model=hf, atol=LOGIT_TOL, rtol=LOGIT_TOL)
    assert_kv_bytes_per_token(llm)


def test_greedy_batch_with_chunked_prefill_and_preemption(tiny):
    """Three kinds of prompts, batched together: short ones that stay within
    original_max_position_embeddings with their 32 new tokens, long ones already beyond it,
    and ones that cross it while generating. The first two are compared with
    ``generate``; crossing sequences with a step-by-step cached decode (transformers 5.17's
    Phi-3 ``generate`` discards the context at the crossing; see
    ``pagoda.testing.hf_greedy_tokens``), which is also what ``generate`` gives elsewhere."""
    name, path, hf = tiny
    short = random_prompts(2, VOCAB, 5, 14, seed=7)
    long = random_prompts(2, VOCAB, ORIGINAL + 2, ORIGINAL + 22, seed=8)
    crossing = random_prompts(2, VOCAB, 30, 40, seed=9)
    prompts = [short[0], long[0], crossing[0], short[1], long[1], crossing[1]]
    ref = hf_greedy_tokens(path, short + long, 32, model=hf)
    stepwise = hf_greedy_tokens(path, short + long + crossing, 32, model=hf, stepwise=True)
    assert stepwise[:4] == ref
    expected = dict(zip(map(tuple, short + long + crossing), stepwise))
    # 16 blocks of 8 tokens cannot hold six sequences of up to 102 tokens: preemption happens;
    # a 24-token budget splits the longer prompts into chunks. (Asserted by the helper, which
    # also checks that every KV block is freed.)
    assert_greedy_matches(path, prompts, 32, expected=[expected[tuple(p)] for p in prompts],
                          engine=dict(num_kv_blocks=16, block_size=8, max_num_batched_tokens=24, max_model_len=104,
                                      enable_prefix_caching=True))


def test_recompute_after_crossing_keeps_each_tokens_rotation(tiny):
    """Two 40-token prompts in 13 blocks: at 49 tokens (past original_max_position_embeddings)
    one sequence is preempted and later recomputed; its prompt tokens must be rotated with the
    factors they had (short), as in transformers' cached decode, not with the long ones."""
    name, path, hf = tiny
    if "longrope" not in name:
        pytest.skip("no sequence-length-dependent rope")
    prompts = random_prompts(2, VOCAB, 40, 40, seed=12)
    assert_greedy_matches(path, prompts, 32, hf_model=hf, stepwise=True,
                          engine=dict(num_kv_blocks=13, block_size=8, max_num_batched_tokens=24, max_model_len=104,
                                      enable_prefix_caching=True))


def test_every_checkpoint_tensor_is_loaded(tiny):
    """The fused qkv_proj / gate_up_proj tensors are read and split into every parameter."""
    _, path, _ = tiny
    assert_weights_consumed(path)


def test_prefix_caching_off_only_when_the_long_factors_are_reachable(tiny):
    name, path, _ = tiny
    longrope = "longrope" in name
    reach = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=16, block_size=8, max_model_len=104)
    assert reach.engine.block_manager.enable_prefix_caching is not longrope
    within = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=16, block_size=8,
                 max_model_len=ORIGINAL)
    assert within.engine.block_manager.enable_prefix_caching


def test_unexpected_fused_size_names_the_tensor(tmp_path):
    path = make_tiny_checkpoint("phi3", tmp_path / "ckpt", seed=3, **TINY)
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_key_value_heads"] = 1  # q 64 + k 16 + v 16 rows, but the checkpoint has 128
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"model.safetensors: tensor 'model.layers.0.self_attn.qkv_proj.weight'"
                                             r".*fused size 96"):
        LLM(model=str(bad), device="cpu", dtype="float32", num_kv_blocks=32, block_size=8)
