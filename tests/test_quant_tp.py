"""Quantized models split over two processes (gloo on CPU): packed INT4 and block-scaled FP8
layouts are sliced per rank (fused q/k/v and gate/up pieces, row-parallel groups) and give the
same logits as one process."""

import pytest
import torch
from pagoda import LLM
from pagoda.testing import make_tiny_checkpoint, random_prompts
from pagoda_quant.formats.writers import quantize_checkpoint

VOCAB = 320
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attention_bias=True)
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=16, block_size=8, max_model_len=64)
CASES = {
    "gptq-v2": dict(fmt="gptq", group_size=16, symmetric=False, v2=True),
    "fp8-block": dict(fmt="fp8-block", block=(16, 16)),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=2, **LLAMA)


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_quantized_checkpoint_matches_one_process(llama, tmp_path, name):
    opts = dict(CASES[name])
    path = tmp_path / name
    quantize_checkpoint(llama, path, opts.pop("fmt"), **opts)
    prompt = random_prompts(1, VOCAB, 30, 30, seed=4)[0]
    want = LLM(model=str(path), **ENGINE).prompt_logits(prompt)
    tp = LLM(model=str(path), tensor_parallel_size=2, **ENGINE)
    try:
        torch.testing.assert_close(tp.prompt_logits(prompt), want, rtol=1e-4, atol=1e-4)
    finally:
        tp.shutdown()
