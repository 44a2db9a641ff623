"""FP8 KV cache (``kv_cache_dtype: fp8``): per-layer scales, from the checkpoint or 1.0, with
the torch reference backend."""

import json

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError
from pagoda.kernels.reference import store_kv_cache
from pagoda.selection import get_quantizer
from pagoda.testing import make_tiny_checkpoint, random_prompts
from pagoda_quant.formats.writers import quantize_checkpoint
from safetensors.torch import load_file, save_file

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=48, block_size=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=5, **TINY)


def test_store_kv_cache_scales_and_saturates():
    cache = torch.zeros(2, 3, 4, 2, 8, dtype=torch.float8_e4m3fn)  # [2, blocks, block_size, heads, head]
    torch.manual_seed(0)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8) * 100
    slots = torch.tensor([5, -1, 0])  # -1: padding, skipped
    k_scale, v_scale = torch.tensor(0.01), torch.tensor(0.05)
    store_kv_cache(k, v, cache, slots, k_scale, v_scale)
    flat_k, flat_v = cache[0].view(-1, 2, 8).float(), cache[1].view(-1, 2, 8).float()
    torch.testing.assert_close(flat_k[5], (k[0] / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert float(flat_v[0].abs().max()) == 448.0  # |v| / 0.05 exceeds the fp8 range: saturated, not NaN
    assert not bool(torch.isnan(cache.float()).any())
    assert float(flat_k[1].abs().sum()) == 0.0  # the padding slot was not written


def test_fp8_cache_halves_memory_and_stays_close(tiny):
    full = LLM(model=str(tiny), **ENGINE)
    fp8 = LLM(model=str(tiny), kv_cache_dtype="fp8", **ENGINE)
    runner = fp8.engine.runner
    assert all(c.dtype == torch.float8_e4m3fn for c in runner.kv_caches)
    assert runner.bytes_per_block() * 4 == full.engine.runner.bytes_per_block()  # float32 -> 1 byte
    assert all(float(layer.kv_scales["k_scale"]) == 1.0 for layer in runner.attn_layers)
    for prompt in random_prompts(2, 320, 20, 40, seed=1):
        want, got = full.prompt_logits(prompt), fp8.prompt_logits(prompt)
        assert float((got - want).norm() / want.norm()) < 0.06
    outs = fp8.generate(random_prompts(3, 320, 5, 20, seed=2), SamplingParams(temperature=0, max_tokens=8,
                                                                              ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


def _with_scales(src, dst, tensors: dict) -> None:
    dst.mkdir()
    state = load_file(str(src / "model.safetensors"))
    state.update(tensors)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_checkpoint_kv_scales_are_loaded_per_layer(tiny, tmp_path):
    path = tmp_path / "scaled"
    _with_scales(tiny, path, {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.02), "model.layers.0.self_attn.v_scale": torch.tensor(0.01),
        # the older names: one scale for both, or the k/v projections' output scales
        "model.layers.1.self_attn.kv_scale": torch.tensor([0.03]),
        "model.layers.1.self_attn.v_proj.output_scale": torch.tensor(0.04)})
    llm = LLM(model=str(path), kv_cache_dtype="fp8", **ENGINE)
    scales = [{k: round(float(v), 6) for k, v in layer.kv_scales.items()} for layer in llm.engine.runner.attn_layers]
    assert scales == [{"k_scale": 0.02, "v_scale": 0.01}, {"k_scale": 0.03, "v_scale": 0.04}]
    full = LLM(model=str(tiny), **ENGINE)
    prompt = random_prompts(1, 320, 30, 30, seed=3)[0]
    want, got = full.prompt_logits(prompt), llm.prompt_logits(prompt)
    assert float((got - want).norm() / want.norm()) < 0.06
    # with a full-precision cache the scales are read and unused
    assert LLM(model=str(path), **ENGINE).prompt_logits(prompt).allclose(want, atol=1e-5)


def test_a_bad_kv_scale_tensor_is_named(tiny, tmp_path):
    from pagoda.errors import ModelLoadError

    path = tmp_path / "bad"
    _with_scales(tiny, path, {"model.layers.0.self_attn.k_scale": torch.ones(4)})
    with pytest.raises(ModelLoadError, match="model.layers.0.self_attn.k_scale.*one value"):
        LLM(model=str(path), kv_cache_dtype="fp8", **ENGINE)


# how checkpoints declare an FP8 KV cache in quantization_config (the k/v scales are tensors)
KV_CACHE_DECLARATIONS = {
    "compressed-tensors": {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                               "symmetric": True}},
    "autofp8": {"kv_cache_scheme": "static"},
    "modelopt": {"kv_cache_quant_algo": "FP8"},
}


@pytest.mark.parametrize("declared", list(KV_CACHE_DECLARATIONS))
def test_quantizers_read_the_declared_kv_cache(declared):
    def kv_cache_of(method: str, **cfg):
        return get_quantizer(method).from_checkpoint({"quant_method": method, **cfg}).kv_cache_dtype()

    assert kv_cache_of("fp8", **KV_CACHE_DECLARATIONS[declared]) == "fp8"
    assert kv_cache_of("gptq", bits=4, **KV_CACHE_DECLARATIONS[declared]) == "fp8"
    assert kv_cache_of("awq", bits=4, **KV_CACHE_DECLARATIONS[declared]) == "fp8"
    assert kv_cache_of("fp8", kv_cache_scheme=None) is None
    # a cache type pagoda has no kernels for leaves the cache in the model dtype
    assert kv_cache_of("fp8", kv_cache_scheme={"num_bits": 8, "type": "int"}) is None


def test_checkpoint_declaring_an_fp8_cache_selects_it_unless_the_user_sets_one(tiny, tmp_path):
    path = tmp_path / "fp8-kv"
    quantize_checkpoint(tiny, path, "fp8")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(KV_CACHE_DECLARATIONS["compressed-tensors"])
    (path / "config.json").write_text(json.dumps(config))
    state = load_file(str(path / "model.safetensors"))
    state.update({f"model.layers.{i}.self_attn.{n}_scale": torch.tensor(0.05) for i in (0, 1) for n in "kv"})
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})

    auto = LLM(model=str(path), **ENGINE).engine.runner  # kv_cache_dtype: auto
    assert auto.kv_cache_dtype() == torch.float8_e4m3fn
    assert all(c.dtype == torch.float8_e4m3fn for c in auto.kv_caches)
    assert all(float(layer.kv_scales["v_scale"]) == pytest.approx(0.05) for layer in auto.attn_layers)
    # the user's explicit setting wins: the model dtype by name keeps a full-precision cache
    full = LLM(model=str(path), kv_cache_dtype="float32", **ENGINE).engine.runner
    assert full.kv_cache_dtype() == torch.float32 and all(c.dtype == torch.float32 for c in full.kv_caches)
    with pytest.raises(ConfigError, match="kv_cache_dtype 'bfloat16'.*model dtype float32"):
        LLM(model=str(path), kv_cache_dtype="bfloat16", **ENGINE)


def test_a_declared_cache_pagoda_cannot_store_is_an_error_naming_the_quantizer():
    from pagoda.engine.model_runner import resolve_kv_cache_dtype
    from pagoda.interfaces import QuantConfig

    class Declares(QuantConfig):
        name = "thirdparty"

        def kv_cache_dtype(self):
            return "int8"

    assert resolve_kv_cache_dtype("fp8", Declares(), torch.bfloat16) == "fp8"  # explicit: not consulted
    assert resolve_kv_cache_dtype("auto", QuantConfig(), torch.bfloat16) == "auto"  # declares none
    with pytest.raises(ConfigError, match="quantization 'thirdparty' declares KV cache dtype 'int8'.*kv_cache_dtype"):
        resolve_kv_cache_dtype("auto", Declares(), torch.bfloat16)


def test_store_mla_cache_scales_and_saturates():
    from pagoda.kernels.reference import store_mla_cache

    cache = torch.zeros(3, 4, 12, dtype=torch.float8_e4m3fn)  # [blocks, block_size, L + R] with L=8, R=4
    torch.manual_seed(0)
    kv_c, k_pe = torch.randn(3, 8), torch.randn(3, 4) * 100
    store_mla_cache(kv_c, k_pe, cache, torch.tensor([5, -1, 0]), torch.tensor(0.05))
    flat = cache.view(-1, 12).float()
    want = (torch.cat((kv_c[0], k_pe[0])) / 0.05).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    torch.testing.assert_close(flat[5], want)
    assert float(flat[0, 8:].abs().max()) == 448.0 and not bool(torch.isnan(flat).any())  # saturated
    assert float(flat[1].abs().sum()) == 0.0  # the padding slot was not written


# dense layers only (first_k_dense_replace = all): MoE routing flips would drown the cache's error
DEEPSEEK = dict(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=2, q_lora_rank=32,
                kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256)


def test_deepseek_v3_fp8_latent_cache_applies_the_checkpoint_scale(tmp_path):
    """The latent is scaled x200 (kv_a_layernorm; kv_b_proj / 200 keeps the model's math), out of
    the fp8 range unscaled: only with the checkpoint's k_scale applied does the fp8 cache stay close."""
    src = make_tiny_checkpoint("deepseek_v3", tmp_path / "src", seed=6, **DEEPSEEK)
    state = load_file(str(src / "model.safetensors"))
    for i in range(DEEPSEEK["num_hidden_layers"]):
        attn = f"model.layers.{i}.self_attn"
        state[f"{attn}.kv_a_layernorm.weight"] = state[f"{attn}.kv_a_layernorm.weight"] * 200
        state[f"{attn}.kv_b_proj.weight"] = state[f"{attn}.kv_b_proj.weight"] / 200
        state[f"{attn}.k_scale"] = torch.tensor(2.0)
    path = tmp_path / "scaled"
    path.mkdir()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text((src / "config.json").read_text())
    full = LLM(model=str(path), **ENGINE)
    fp8 = LLM(model=str(path), kv_cache_dtype="fp8", **ENGINE)
    assert all(c.dtype == torch.float8_e4m3fn for c in fp8.engine.runner.kv_caches)
    assert [float(layer.kv_scales["k_scale"]) for layer in fp8.engine.runner.attn_layers] == [2.0, 2.0]
    for prompt in random_prompts(2, 320, 20, 40, seed=1):
        want, got = full.prompt_logits(prompt), fp8.prompt_logits(prompt)
        assert float((got - want).norm() / want.norm()) < 0.06
    # decode steps read the cache through the absorbed path
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = random_prompts(2, 320, 10, 20, seed=2)
    agree = [a.outputs[0].token_ids == b.outputs[0].token_ids
             for a, b in zip(full.generate(prompts, params), fp8.generate(prompts, params))]
    assert all(agree)
