"""Pre-quantized checkpoints written in the exact on-disk formats (DeepSeek-V3 block FP8,
per-tensor FP8 with static activation scales, GPTQ in both formats with act order, AWQ)
load into pagoda and compute with exactly the weights they dequantize to.

The reference is HF transformers running the same model with the dequantized weights in
full precision: INT4 (weight-only) matches it to float32 rounding; FP8 also quantizes the
activations per token (or with the static scale), which costs a few percent of the logits.
"""

import json

import pytest
import torch
from pagoda import LLM
from pagoda.layers import LinearBase, UnquantizedLinearMethod
from pagoda.testing import hf_prompt_logits, make_tiny_checkpoint, random_prompts
from pagoda_quant.formats.writers import quantize_checkpoint
from pagoda_quant.layer_match import checkpoint_names
from safetensors.torch import save_file

VOCAB = 320
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
DEEPSEEK = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
                kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256)
QWEN3_MOE = dict(TINY, head_dim=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                 norm_topk_prob=True)
ARCHS = {"llama": TINY, "qwen2": TINY, "qwen3": dict(TINY, head_dim=32), "qwen3_moe": QWEN3_MOE,
         "deepseek_v3": DEEPSEEK, "phi3": dict(TINY, pad_token_id=0)}
# name: (architecture, format, options); "skip" modules stay in full precision in the checkpoint
CASES = {
    "fp8-block": ("llama", "fp8-block", dict(block=(32, 32), skip=["model.layers.1.mlp.down_proj"])),
    "fp8-block-deepseek_v3": ("deepseek_v3", "fp8-block", dict(block=(16, 16))),
    "fp8-tensor-static": ("qwen2", "fp8", dict(skip=["model.layers.0.self_attn.o_proj"], calibrate=True)),
    "fp8-tensor-static-moe": ("qwen3_moe", "fp8", dict(calibrate=True)),
    "gptq-actorder": ("qwen2", "gptq", dict(group_size=32, desc_act=True, symmetric=True)),
    "gptq-v2-asym": ("llama", "gptq", dict(group_size=16, symmetric=False, v2=True)),
    "awq": ("qwen3", "awq", dict(group_size=32)),
    # Phi-3 stores qkv_proj and gate_up_proj fused: packed and scale tensors are split per piece on load
    "phi3-fp8-block": ("phi3", "fp8-block", dict(block=(32, 32))),
    "phi3-fp8-tensor-static": ("phi3", "fp8", dict(calibrate=True)),
    "phi3-gptq-actorder": ("phi3", "gptq", dict(group_size=32, desc_act=True, symmetric=True)),
    "phi3-awq": ("phi3", "awq", dict(group_size=32, skip=["model.layers.1.mlp.gate_up_proj"])),
}
# relative L2 error of the prompt logits against transformers on the dequantized weights:
# float32 rounding for weight-only INT4; FP8 activation quantization (measured 0.05-0.07 on
# the dense models, up to 0.12 through DeepSeek-V3's MLA and routed experts)
LOGIT_REL_TOL = {"fp8": 0.09, "fp8-block": 0.09, "fp8-block-deepseek_v3": 0.16, "gptq": 1e-5, "awq": 1e-5}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return {arch: make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch), seed=4, **fields)
            for arch, fields in ARCHS.items()}


def _input_amax(src) -> dict[str, float]:
    """Static activation scales as a calibration would set them: each linear layer's input amax."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, n=n: amax.__setitem__(n, max(
        amax.get(n, 0.0), float(args[0].abs().max())))) for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for prompt in random_prompts(4, VOCAB, 20, 40, seed=9):
            model(torch.tensor([prompt]))
    for h in hooks:
        h.remove()
    return amax


@pytest.fixture(scope="module", params=list(CASES))
def case(request, sources, tmp_path_factory):
    arch, fmt, opts = CASES[request.param]
    opts = dict(opts)
    src = sources[arch]
    if opts.pop("calibrate", False):
        opts["input_amax"] = _input_amax(src)
    dst = tmp_path_factory.mktemp(request.param)
    reference = quantize_checkpoint(src, dst / "quantized", fmt, **opts)
    ref_dir = dst / "dequantized"
    ref_dir.mkdir()
    save_file({k: v.contiguous() for k, v in reference.items()}, str(ref_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (ref_dir / "config.json").write_text((src / "config.json").read_text())
    return request.param, fmt, opts, dst / "quantized", ref_dir, reference


def test_checkpoint_is_in_the_format(case):
    name, fmt, opts, path, _, _ = case
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    from safetensors import safe_open

    tensors = safe_open(str(path / "model.safetensors"), "pt")
    keys = set(tensors.keys())
    fused = name.startswith("phi3")  # Phi-3 stores gate_up_proj fused: N = 2 * intermediate_size
    layer, n = ("model.layers.0.mlp.gate_up_proj", 256) if fused else ("model.layers.0.mlp.gate_proj", 128)
    if fmt == "fp8-block":
        assert config["quant_method"] == "fp8" and config["weight_block_size"] == list(opts["block"])
        assert tensors.get_tensor(f"{layer}.weight").dtype == torch.float8_e4m3fn
        assert tensors.get_tensor(f"{layer}.weight_scale_inv").dtype == torch.float32
    elif fmt == "fp8":
        assert config["activation_scheme"] == "static" and config["ignored_layers"] == opts.get("skip", [])
        layer = "model.layers.0.mlp.experts.3.up_proj" if "moe" in name else layer
        assert tensors.get_tensor(f"{layer}.weight_scale").shape == ()
        assert f"{layer}.input_scale" in keys
        assert ("model.layers.0.self_attn.o_proj.weight_scale" in keys) == ("skip" not in opts)
    elif fmt == "gptq":
        assert (config["bits"], config["desc_act"]) == (4, opts["desc_act"] if "desc_act" in opts else False)
        assert config["checkpoint_format"] == ("gptq_v2" if opts.get("v2") else "gptq")
        qweight = tensors.get_tensor(f"{layer}.qweight")
        assert qweight.dtype == torch.int32 and qweight.shape == (64 // 8, n)  # [K/8, N]
        assert tensors.get_tensor(f"{layer}.qzeros").shape == (64 // opts["group_size"], n // 8)
        assert tensors.get_tensor(f"{layer}.scales").dtype == torch.float16
        if opts.get("symmetric"):  # zero point 8 stored as 7 in every nibble
            assert bool((tensors.get_tensor(f"{layer}.qzeros") == 0x77777777).all())
    elif fmt == "awq":
        assert (config["version"], config["zero_point"]) == ("gemm", True)
        assert tensors.get_tensor(f"{layer}.qweight").shape == (64, n // 8)  # [K, N/8]


def test_loaded_layers_compute_with_the_dequantized_weights(case):
    name, fmt, opts, path, _, reference = case
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=32, block_size=8)
    quantized = 0
    for prefix, module in llm.engine.runner.model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, LinearBase):
            names = [prefix] if f"{prefix}.weight" in reference else checkpoint_names(prefix)  # Phi-3: fused
            want = torch.cat([reference[f"{n}.weight"] for n in names])
            if any(s in prefix for s in opts.get("skip", [])) or prefix.endswith("mlp.gate"):
                assert isinstance(method, UnquantizedLinearMethod), prefix
                continue
            torch.testing.assert_close(method.dequantize(module), want, rtol=0, atol=1e-6, msg=prefix)
            quantized += 1
        elif method is not None and hasattr(method, "dequantize_all"):  # MoE experts
            w13 = method.dequantize_all(module, "w13")
            for e in range(w13.shape[0]):
                want = torch.cat([reference[f"{prefix}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")])
                torch.testing.assert_close(w13[e], want, rtol=0, atol=1e-6)
            quantized += 1
    assert quantized >= 6


def test_logits_match_transformers_on_dequantized_weights(case):
    name, fmt, _, path, ref_dir, _ = case
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=32, block_size=8)
    for prompt in random_prompts(2, VOCAB, 12, 40, seed=5):
        ours, want = llm.prompt_logits(prompt), hf_prompt_logits(ref_dir, prompt)
        rel = float((ours - want).norm() / want.norm())
        assert rel < LOGIT_REL_TOL.get(name, LOGIT_REL_TOL[fmt]), (name, rel)
