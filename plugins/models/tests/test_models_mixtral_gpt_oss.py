"""Mixtral and GPT-OSS tiny random models against transformers (sparse MoE through the core's
FusedMoE; GPT-OSS's sinks, alternating windows, YaRN, biased experts with the clamped SwiGLU),
and GPT-OSS checkpoints whose experts are MXFP4 blocks, as the published ones are."""

import json

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.loader.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from pagoda.testing import (
    assert_greedy_matches,
    assert_kv_bytes_per_token,
    assert_prefix_cache_matches,
    assert_prompt_logits_match,
    assert_weights_consumed,
    hf_expert_counts,
    hf_prompt_logits,
    make_tiny_checkpoint,
    random_prompts,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

VOCAB = 320
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, num_local_experts=8, num_experts_per_tok=2)
YARN = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=32, rope_theta=150000.0)
VARIANTS = {
    "mixtral": ("mixtral", dict(TINY)),
    "mixtral-window": ("mixtral", dict(TINY, num_experts_per_tok=3, sliding_window=12)),
    # layers sliding then global; a YaRN switch inside the prompts
    "gpt_oss": ("gpt_oss", dict(TINY, head_dim=16, sliding_window=12, rope_parameters=YARN)),
}
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    model_type, fields = VARIANTS[request.param]
    path = make_tiny_checkpoint(model_type, tmp_path_factory.mktemp(request.param), seed=2, **fields)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, hf


def test_prompt_logits_match_transformers(tiny):
    path, hf = tiny
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8)
    assert_prompt_logits_match(llm, path, random_prompts(2, VOCAB, 20, 60, seed=3), hf_model=hf, atol=LOGIT_TOL,
                               rtol=LOGIT_TOL)
    assert_kv_bytes_per_token(llm)


def test_greedy_batch_with_chunked_prefill_and_preemption(tiny):
    path, hf = tiny
    assert_greedy_matches(path, random_prompts(6, VOCAB, 5, 45, seed=7), 32, hf_model=hf,
                          engine=dict(num_kv_blocks=12, block_size=8, max_num_batched_tokens=24, max_model_len=80,
                                      enable_prefix_caching=False))


def test_prefix_caching(tiny):
    path, hf = tiny
    prefix = random_prompts(1, VOCAB, 40, 40, seed=12)[0]
    assert_prefix_cache_matches(path, prefix, random_prompts(4, VOCAB, 3, 20, seed=13), 12, hf_model=hf)


def test_every_checkpoint_tensor_is_loaded(tiny):
    path, _ = tiny
    assert_weights_consumed(path)


def test_expert_counts_match_the_routers_choices(tiny):
    path, hf = tiny
    prompts = random_prompts(4, VOCAB, 4, 30, seed=11)
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8,
              max_num_batched_tokens=16, enable_prefix_caching=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    fed = [p + o.outputs[0].token_ids[:-1] for p, o in zip(prompts, outs)]
    ours = {name: counts for name, counts in llm.get_stats()["expert_load"]["layers"].items()}
    theirs = hf_expert_counts(path, fed, hf)  # model.layers.N.mlp.gate / .mlp.router
    renamed = {name.replace(".mlp.gate", ".block_sparse_moe.experts").replace(".mlp.router", ".mlp.experts"): c
               for name, c in theirs.items()}
    assert ours == renamed


# ---------------------------------------------------------------------------- MXFP4
def test_mxfp4_dequantization_matches_transformers():
    """pagoda's reading of MXFP4 blocks (codes, nibble order, scale bias) against transformers'."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 8, 2), generator=gen, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, C, R]: transposed
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), theirs.transpose(1, 2))
    values = torch.randn(4, 64, generator=gen)
    again = dequantize_mxfp4(*quantize_mxfp4(values), torch.float32)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(again), torch.float32), again)  # a fixed point
    assert (again - values).abs().max() <= values.abs().max() / 4  # e2m1: coarse, but near


def write_mxfp4_pair(source, tmp_path):
    """From a tiny GPT-OSS checkpoint: an MXFP4 copy (experts as *_blocks / *_scales, quant_method
    mxfp4, as published) and a float32 copy holding exactly the values the MXFP4 one decodes to."""
    state = load_file(str(source / "model.safetensors"))
    packed, plain = {}, {}
    for name, tensor in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2).contiguous())  # [E, rows, cols] as stored
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            plain[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
        else:
            packed[name] = plain[name] = tensor
    config = json.loads((source / "config.json").read_text())
    out = {}
    for kind, tensors, extra in (("mxfp4", packed, {"quantization_config": {
            "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                               "model.embed_tokens", "lm_head"]}}),
                                 ("plain", plain, {})):
        folder = tmp_path / kind
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(dict(config, **extra)))
        out[kind] = folder
    return out["mxfp4"], out["plain"]


def test_mxfp4_checkpoint_loads_dequantized(tmp_path, caplog):
    model_type, fields = VARIANTS["gpt_oss"]
    source = make_tiny_checkpoint(model_type, tmp_path / "source", seed=4, **fields)
    mxfp4, plain = write_mxfp4_pair(source, tmp_path)
    assert_weights_consumed(mxfp4)
    with caplog.at_level("INFO", logger="pagoda"):
        llm = LLM(model=str(mxfp4), device="cpu", dtype="float32", num_kv_blocks=16, block_size=8, max_model_len=64)
    assert "MXFP4 experts dequantized" in caplog.text
    prompt = random_prompts(1, VOCAB, 30, 30, seed=5)[0]
    torch.testing.assert_close(llm.prompt_logits(prompt), hf_prompt_logits(plain, prompt), atol=LOGIT_TOL,
                               rtol=LOGIT_TOL)
