"""Every quantization method on a tiny random model of every supported architecture.

For each (architecture, method): the quantized model's prompt logits stay within the method's
stated relative error of the full-precision model, and greedy generation runs through the
continuous-batching path. For weight-only INT4 the quantized model must equal, to float32
rounding, the full-precision model running the dequantized weights: the kernels compute
exactly with what was stored, on attention, dense MLPs, MLA and MoE experts alike.
"""

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.layers import LinearBase
from pagoda.testing import make_tiny_checkpoint, random_prompts

VOCAB = 320
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, moe_intermediate_size=32)
ARCHS = {
    "llama": ("llama", dict(TINY, attention_bias=True)),
    "mistral": ("mistral", dict(TINY, sliding_window=16)),
    "qwen2": ("qwen2", TINY),
    "qwen3": ("qwen3", dict(TINY, head_dim=32)),
    "phi3": ("phi3", dict(TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "qwen2_moe": ("qwen2_moe", dict(TINY, num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=64)),
    "qwen3_moe": ("qwen3_moe", dict(TINY, head_dim=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "deepseek_v3": ("deepseek_v3", dict(TINY, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                                        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                                        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                        v_head_dim=16)),
}
POLICY = {"default": "fp8", "rules": [{"kind": "experts", "method": "int4", "group_size": 16},
                                      {"kind": "mlp", "method": "int4", "group_size": 32}]}
# method -> the largest relative L2 error of the prompt logits against full precision
METHODS = {
    "fp8": ("fp8", 0.2),
    "fp8-tensor": ({"method": "fp8", "weight_scale": "tensor"}, 0.25),
    "fp8-block": ({"method": "fp8", "weight_block_size": [16, 16]}, 0.2),
    "int4": ({"method": "int4", "group_size": 16}, 0.3),
    "int4-sym": ({"method": "int4", "group_size": 32, "symmetric": True}, 0.4),
    "mixed": (POLICY, 0.3),
}
# DeepSeek-V3's low-rank MLA projections and routed experts amplify weight error in a random
# tiny model (measured: fp8 0.27, int4 0.42 at seed 6): its bounds are twice the others'
ARCH_ERROR_SCALE = {"deepseek_v3": 2.0}
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=48, block_size=8)


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory):
    model_type, fields = ARCHS[request.param]
    path = make_tiny_checkpoint(model_type, tmp_path_factory.mktemp(request.param), seed=6, **fields)
    full = LLM(model=str(path), **ENGINE)
    prompts = random_prompts(2, VOCAB, 10, 30, seed=8)
    return request.param, path, full, [full.prompt_logits(p) for p in prompts], prompts


@pytest.mark.parametrize("method", list(METHODS))
def test_quantized_logits_within_stated_error(arch, method):
    name, path, _, full_logits, prompts = arch
    setting, tolerance = METHODS[method]
    tolerance *= ARCH_ERROR_SCALE.get(name, 1.0)
    llm = LLM(model=str(path), quantization=setting, **ENGINE)
    for prompt, want in zip(prompts, full_logits):
        got = llm.prompt_logits(prompt)
        rel = float((got - want).norm() / want.norm())
        assert rel < tolerance, (name, method, rel)
        assert rel > 1e-4, (name, method, "nothing was quantized")
    if method == "mixed":  # the batched engine path (chunked prefill, decode) runs quantized
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]


def _copy_dequantized_weights(full_model, quantized_model) -> int:
    """Put every quantized layer's dequantized weights into the full-precision model."""
    copied = 0
    full = dict(full_model.named_modules())
    for name, module in quantized_model.named_modules():
        method = getattr(module, "quant_method", None)
        target = full.get(name)
        if isinstance(module, LinearBase) and hasattr(method, "dequantize"):
            target.weight.data.copy_(method.dequantize(module))
            copied += 1
        elif hasattr(method, "dequantize_all"):
            target.w13_weight.data.copy_(method.dequantize_all(module, "w13"))
            target.w2_weight.data.copy_(method.dequantize_all(module, "w2"))
            copied += 1
    return copied


def test_int4_computes_exactly_with_the_dequantized_weights(arch):
    name, path, _, _, prompts = arch
    quantized = LLM(model=str(path), quantization={"method": "int4", "group_size": 16}, **ENGINE)
    reference = LLM(model=str(path), **ENGINE)
    assert _copy_dequantized_weights(reference.engine.runner.model, quantized.engine.runner.model) >= 6
    for prompt in prompts:
        torch.testing.assert_close(quantized.prompt_logits(prompt), reference.prompt_logits(prompt),
                                   rtol=1e-4, atol=1e-4)


def test_quantized_weights_take_less_memory(arch):
    name, path, full, _, _ = arch

    def weight_bytes(llm):
        return sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())

    fp8 = LLM(model=str(path), quantization="fp8", **ENGINE)
    int4 = LLM(model=str(path), quantization={"method": "int4", "group_size": 16}, **ENGINE)
    # embeddings and the LM head stay in float32 (a large share of these tiny models)
    assert weight_bytes(int4) < weight_bytes(fp8) < 0.8 * weight_bytes(full)
