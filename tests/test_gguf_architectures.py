"""GGUF files of the architectures beyond the Llama family, in llama.cpp's layout: Phi-3 (fused qkv and
gate_up, split into HF's pieces at load), Qwen2-MoE (shared expert and its gate) and Qwen3-MoE (stacked
experts, renormalised top-k). Each file is written from a tiny random HF checkpoint; pagoda's greedy
tokens equal transformers' on the checkpoint, and transformers' own GGUF loader reads the same file to
the same tokens (so the file is llama.cpp's layout, not only one pagoda reads back). A Q8_0 file keeps
its blocks on the CPU (experts widened) and generates what the float path of the same file does."""

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.testing import hf_greedy_tokens, make_tiny_checkpoint, random_prompts
from pagoda.testing.gguf_files import write_gguf_from_checkpoint

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
# expert sizes at transformers' defaults: its GGUF loader reads no expert_feed_forward_length
ARCHS = {
    "phi3": dict(pad_token_id=0),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True,
                      head_dim=16),
}
PROMPTS = random_prompts(3, 320, 5, 20, seed=2)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
KW = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=32, block_size=8)


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return request.param, root, make_tiny_checkpoint(request.param, root / "hf", seed=1, **BASE, **ARCHS[request.param])


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_float_file_generates_what_transformers_does_on_the_checkpoint(checkpoint):
    from transformers import AutoModelForCausalLM

    arch, root, hf = checkpoint
    path = write_gguf_from_checkpoint(hf, root / "model-F32.gguf")
    want = hf_greedy_tokens(hf, PROMPTS, 10)
    llm = LLM(model=str(path), **KW)
    assert type(llm.engine.runner.model).__name__ == {"phi3": "Phi3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                                                      "qwen3_moe": "Qwen3MoeForCausalLM"}[arch]
    assert _tokens(llm) == want
    theirs = AutoModelForCausalLM.from_pretrained(str(root), gguf_file=path.name, dtype=torch.float32)
    for prompt, tokens in zip(PROMPTS, want):
        out = theirs.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert out[0, len(prompt):].tolist() == tokens


def test_q8_0_file_keeps_its_blocks_and_matches_its_float_path(checkpoint):
    arch, root, hf = checkpoint
    path = write_gguf_from_checkpoint(hf, root / "model-Q8_0.gguf", ggml_type="Q8_0")
    packed, reference = LLM(model=str(path), **KW), LLM(model=str(path), **KW, quantization="none")
    layer = packed.engine.runner.model.model.layers[0]
    assert packed.engine.runner.model.quant_config.name == "gguf"
    # q, k and v (phi3: rows of one fused tensor) kept as one quantized segment
    segments = layer.self_attn.qkv_proj.gguf_segments
    assert len(segments) == 1 and (segments[0].dot is not None or len(segments[0].planes) == 2)
    # along the float path's own continuation: logits within the kernel's int8 (or bf16) activations'
    # error, and the same greedy choice wherever the float path's choice is clear of that error (a random
    # tiny model has ties)
    for prompt, continuation in zip(PROMPTS, _tokens(reference)):
        ids = prompt + continuation
        a, b = packed.prompt_logits(ids), reference.prompt_logits(ids)
        err = float((a - b).abs().max())
        assert err < 0.05 * float(b.abs().max())  # (as for the Llama K-quant file in test_gguf_cpu.py)
        top2 = b.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * err
        assert bool((a.argmax(-1) == b.argmax(-1))[clear].all()) and bool(clear.any())
