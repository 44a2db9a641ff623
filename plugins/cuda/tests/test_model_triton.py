"""A whole tiny model through the triton backend and the Triton kernel ops (interpreter on
CPU) against HF transformers: chunked prefill, mixed batches and decodes."""

import pytest
import torch
from pagoda import LLM, SamplingParams, kernels
from pagoda.plugins import get_registry
from pagoda.testing import hf_greedy_tokens, hf_prompt_logits, make_tiny_checkpoint, random_prompts
from pagoda_cuda.plugin import KERNELS

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
MODELS = {
    "qwen3": dict(BASE, head_dim=32),
    "qwen3_moe": dict(BASE, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True),
    "deepseek_v3": dict(BASE, num_key_value_heads=4, moe_intermediate_size=32, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=12, first_k_dense_replace=1, q_lora_rank=32,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1),
    # DeepSeek sparse attention: a top-8 indexer, shorter than most prompts
    "deepseek_v32": dict(BASE, num_key_value_heads=4, moe_intermediate_size=32, kv_lora_rank=16, qk_rope_head_dim=8,
                         qk_nope_head_dim=16, v_head_dim=12, first_k_dense_replace=1, q_lora_rank=32,
                         n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                         index_topk=8, index_head_dim=16, index_n_heads=8),
    # a sliding and a global layer (two KV cache groups), a window shorter than the prompts, q/k (1 + w) norms
    "gemma3_text": dict(BASE, head_dim=32, sliding_window=12, query_pre_attn_scalar=24,
                        layer_types=["sliding_attention", "full_attention"]),
    # sinks, alternating windows, YaRN, biased experts with the clamped SwiGLU
    "gpt_oss": dict(BASE, head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=12, rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                                            truncate=False, original_max_position_embeddings=32,
                                                            rope_theta=150000.0)),
}
# the kernel ops each model must take from the plugin
OPS = {
    "qwen3": ["qk_norm_rotary", "rms_norm", "fused_add_rms_norm", "silu_and_mul"],  # q/k norms fused into the rotary
    "qwen3_moe": ["qk_norm_rotary", "rms_norm", "fused_add_rms_norm", "fused_moe"],
    "deepseek_v3": ["rotary_embedding", "rms_norm", "fused_add_rms_norm", "fused_moe"],
    "deepseek_v32": ["rotary_embedding", "rms_norm", "fused_add_rms_norm", "fused_moe"],
    "gemma3_text": ["rotary_embedding", "rms_norm_offset", "fused_add_rms_norm_offset", "gelu_tanh_and_mul"],
    "gpt_oss": ["rotary_embedding", "rms_norm_offset", "fused_add_rms_norm_offset", "fused_moe"],
}


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


@pytest.mark.parametrize("model_type", list(MODELS))
def test_tiny_model_matches_transformers(tmp_path, device, triton_ops_here, model_type):
    path = make_tiny_checkpoint(model_type, tmp_path, seed=1, **MODELS[model_type])
    prompts = random_prompts(4, 320, 5, 30, seed=7)
    want = hf_greedy_tokens(path, prompts, 8)
    backend = {"deepseek_v3": "triton_mla", "deepseek_v32": "triton_mla_sparse"}.get(model_type, "triton")
    llm = LLM(model=str(path), device=device.type, dtype="float32", attention_backend=backend, num_kv_blocks=48,
              block_size=8, max_num_batched_tokens=24, max_model_len=64, enforce_eager=True)
    assert {b.name for b in llm.engine.runner.backends.values()} == {backend}
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    if device.type == "cpu":
        assert {kernels.selected_providers()[op] for op in OPS[model_type]} == {"pagoda-cuda (test)"}
    assert [o.outputs[0].token_ids for o in outs] == want
    if device.type == "cuda":  # eager steps launched ahead of the host (the step pipeline)
        assert llm.engine.pipeline.launched_ahead > 0
    ours = llm.prompt_logits(prompts[0])
    torch.testing.assert_close(ours, hf_prompt_logits(path, prompts[0]), atol=3e-4, rtol=3e-4)
    if device.type == "cuda":  # the same through CUDA graphs
        del llm
        llm = LLM(model=str(path), device="cuda", dtype="float32", attention_backend=backend, num_kv_blocks=48,
                  block_size=8, max_num_batched_tokens=24, max_model_len=64, max_num_seqs=8)
        assert llm.engine.runner.graphs is not None
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.engine.pipeline.launched_ahead > 0
