"""A whole tiny model through the triton backend and the Triton kernel ops (interpreter on
CPU) against HF transformers: chunked prefill, mixed batches and decodes."""

import pytest
import torch
from pagoda import LLM, SamplingParams, kernels
from pagoda.plugins import get_registry
from pagoda.testing import hf_greedy_tokens, hf_prompt_logits, make_tiny_checkpoint, random_prompts
from pagoda_cuda.plugin import KERNELS

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=128)


@pytest.fixture
def triton_ops_here(device):
    """Make the cuda plugin's kernel ops win on this test's platform too (on CPU they run
    in the interpreter), and take them out again afterwards."""
    reg = get_registry().kernels
    added = []
    if device.type == "cpu":
        for op, impl in KERNELS.items():
            entry = ("cpu", 1000, impl, "pagoda-cuda (test)")
            reg.impls.setdefault(op, []).append(entry)
            added.append((op, entry))
    yield
    for op, entry in added:
        reg.impls[op].remove(entry)
    kernels.activate(kernels.active_platform())


def test_tiny_qwen3_matches_transformers(tmp_path, device, triton_ops_here):
    path = make_tiny_checkpoint("qwen3", tmp_path, seed=1, **TINY)
    prompts = random_prompts(4, 320, 5, 30, seed=7)
    want = hf_greedy_tokens(path, prompts, 10)
    llm = LLM(model=str(path), device=device.type, dtype="float32", attention_backend="triton", num_kv_blocks=48,
              block_size=8, max_num_batched_tokens=24, max_model_len=64, enforce_eager=True)
    assert type(llm.engine.runner.backends["mha"]).__name__ == "TritonPagedAttention"
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    if device.type == "cpu":
        assert {kernels.selected_providers()[op] for op in ("rotary_embedding", "rms_norm", "silu_and_mul",
                                                            "fused_add_rms_norm")} == {"pagoda-cuda (test)"}
    assert [o.outputs[0].token_ids for o in outs] == want
    ours = llm.prompt_logits(prompts[0])
    torch.testing.assert_close(ours, hf_prompt_logits(path, prompts[0]), atol=3e-4, rtol=3e-4)
