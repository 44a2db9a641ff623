"""Quantized models split over two processes (gloo on CPU): packed INT4 and block-scaled FP8
layouts are sliced per rank (fused q/k/v and gate/up pieces, row-parallel groups) and give the
same logits as one process; Phi-3's checkpoint stores those pieces fused (split on load)."""

import pytest
import torch
from pagoda import LLM
from pagoda.testing import make_tiny_checkpoint, random_prompts
from pagoda_quant.formats.writers import quantize_checkpoint

VOCAB = 320
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attention_bias=True)
PHI3 = dict(LLAMA, attention_bias=False, pad_token_id=0)
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=16, block_size=8, max_model_len=64)
CASES = {
    "gptq-v2": dict(arch="llama", fmt="gptq", group_size=16, symmetric=False, v2=True),
    "fp8-block": dict(arch="llama", fmt="fp8-block", block=(16, 16)),
    "phi3-awq": dict(arch="phi3", fmt="awq", group_size=16),
    "phi3-fp8-block": dict(arch="phi3", fmt="fp8-block", block=(16, 16)),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return {arch: make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch), seed=2, **fields)
            for arch, fields in (("llama", LLAMA), ("phi3", PHI3))}


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_quantized_checkpoint_matches_one_process(sources, tmp_path, name):
    opts = dict(CASES[name])
    path = tmp_path / name
    quantize_checkpoint(sources[opts.pop("arch")], path, opts.pop("fmt"), **opts)
    prompt = random_prompts(1, VOCAB, 30, 30, seed=4)[0]
    want = LLM(model=str(path), **ENGINE).prompt_logits(prompt)
    tp = LLM(model=str(path), tensor_parallel_size=2, **ENGINE)
    try:
        torch.testing.assert_close(tp.prompt_logits(prompt), want, rtol=1e-4, atol=1e-4)
    finally:
        tp.shutdown()
