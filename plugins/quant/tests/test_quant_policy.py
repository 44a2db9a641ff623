"""Mixed quantization policies (which layer gets which method) and the errors a user gets for
a bad quantization setting or checkpoint configuration."""

import json

import pytest
import yaml
from pagoda import LLM
from pagoda.cli.main import main
from pagoda.errors import ConfigError, ModelLoadError, PluginError
from pagoda.layers import LinearBase, UnquantizedLinearMethod
from pagoda.selection import get_quantizer
from pagoda.testing import make_tiny_checkpoint
from pagoda_quant.formats.writers import quantize_checkpoint

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, shared_expert_intermediate_size=64)
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=32, block_size=8)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_tiny_checkpoint("qwen2_moe", tmp_path_factory.mktemp("moe"), seed=3, tokenizer=True, **TINY)


def _methods(llm) -> dict[str, str]:
    return {name: type(m.quant_method).__name__ for name, m in llm.engine.runner.model.named_modules()
            if getattr(m, "quant_method", None) is not None}


def test_policy_assigns_methods_by_kind_name_and_keep_list(moe):
    policy = {"default": "fp8",
              "rules": [{"kind": "experts", "method": "int4", "group_size": 16},
                        {"match": r"layers\.1\.self_attn", "method": "none"}],
              "keep": ["o_proj$"]}
    methods = _methods(LLM(model=str(moe), quantization=policy, **ENGINE))
    assert methods["model.layers.0.self_attn.qkv_proj"] == "Fp8OnlineMethod"
    assert methods["model.layers.1.self_attn.qkv_proj"] == "UnquantizedLinearMethod"  # rule: none
    assert methods["model.layers.0.self_attn.o_proj"] == "UnquantizedLinearMethod"  # keep
    assert methods["model.layers.0.mlp.experts"] == "Int4ExpertsMethod"
    assert methods["model.layers.0.mlp.shared_expert.gate_up_proj"] == "Fp8OnlineMethod"  # default
    assert methods["model.layers.0.mlp.gate"] == "UnquantizedLinearMethod"  # routers never


def test_policy_from_a_yaml_config_file_and_the_cli(moe, tmp_path, capsys):
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"engine": {"model": str(moe), "quantization": {
        "default": "none", "rules": [{"kind": "attention", "method": "fp8", "weight_scale": "tensor"}]}, **ENGINE}}))
    methods = _methods(LLM(config_file=str(config)))
    assert methods["model.layers.1.self_attn.qkv_proj"] == "Fp8OnlineMethod"
    assert methods["model.layers.1.mlp.experts"] == "UnquantizedFusedMoEMethod"
    rc = main(["generate", "--model", str(moe), "--prompt", "hello", "--max-tokens", "4", "--json",
               "--quantization", "{method: int4, group_size: 32}", "--device", "cpu", "--dtype", "float32",
               "--num-kv-blocks", "32"])
    assert rc == 0
    assert len(json.loads(capsys.readouterr().out.splitlines()[0])["outputs"][0]["token_ids"]) == 4


@pytest.mark.parametrize("setting, error, message", [
    ("fp4", PluginError, "quantization method 'fp4' is not registered.*fp8.*int4"),
    ({"method": "int4", "group_sz": 16}, ConfigError, "unknown option.*group_sz.*valid: group_size"),
    ({"method": "int4", "group_size": 0}, ConfigError, "quantization.group_size must be a positive integer"),
    ({"method": "fp8", "weight_scale": "row"}, ConfigError, "weight_scale must be 'channel' or 'tensor'"),
    ({"method": "fp8", "weight_block_size": [128]}, ConfigError, "weight_block_size must be two positive"),
    ({"defaults": "fp8"}, ConfigError, "needs 'method'"),
    ({"default": "fp8", "rules": [{"match": "(", "method": "int4"}]}, ConfigError,
     r"rules\[0\].match.*not a valid regular expression"),
    ({"default": "fp8", "rules": [{"kind": "mlp"}]}, ConfigError, r"rules\[0\] has no 'method'"),
    ({"default": "fp8", "rules": [{"method": "int4"}]}, ConfigError, r"rules\[0\] needs 'match'"),
    ({"default": "fp8", "rules": [{"kind": "router", "method": "int4"}]}, ConfigError, r"rules\[0\].kind must be"),
    ({"default": "fp8", "rules": [{"kind": "mlp", "method": "int4", "group": 8}]}, ConfigError,
     r"rules\[0\].*unknown option.*group"),
    ({"default": "fp8", "extra": 1}, ConfigError, "unknown policy key.*extra"),
    ("gptq", ConfigError, "reads checkpoints already quantized with GPTQ"),
    ({"method": "int4", "group_size": 48}, ModelLoadError,
     "layer model.layers.0.self_attn.qkv_proj has 64 inputs per rank, not a multiple of group_size 48"),
])
def test_bad_settings_name_the_key(moe, setting, error, message):
    with pytest.raises(error, match=message):
        LLM(model=str(moe), quantization=setting, **ENGINE)


@pytest.mark.parametrize("method, cfg, message", [
    ("int4", {}, "'int4' is not a checkpoint format"),
    ("gptq", {"bits": 8, "group_size": 128}, "quantization_config.bits=8"),
    ("gptq", {"bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format='marlin' is not supported"),
    ("gptq", {"bits": 4, "group_size": "x"}, "group_size='x' must be a positive integer"),
    ("awq", {"bits": 4, "version": "gemv"}, "version='gemv'.*GEMM layout only"),
    ("awq", {"bits": 4, "zero_point": False}, "zero_point=false"),
    ("fp8", {"activation_scheme": "weird"}, "activation_scheme='weird' is not supported"),
    ("fp8", {"weight_block_size": [128, 0]}, "weight_block_size must be two positive integers"),
    ("fp8", {"weight_block_size": [128, 128], "activation_scheme": "static"}, "block-scaled FP8.*static"),
])
def test_bad_checkpoint_configs_name_the_key(method, cfg, message):
    with pytest.raises(ModelLoadError, match=message):
        get_quantizer(method).from_checkpoint({"quant_method": method, **cfg})


def test_ignore_list_naming_part_of_a_fused_layer(moe, tmp_path):
    path = tmp_path / "fp8"
    quantize_checkpoint(moe, path, "fp8-block", block=(32, 32), skip=["model.layers.0.self_attn.q_proj"])
    with pytest.raises(ModelLoadError, match="lists model.layers.0.self_attn.q_proj but not the other parts"):
        LLM(model=str(path), **ENGINE)


def test_checkpoint_config_wins_over_the_user_setting(moe, tmp_path):
    path = tmp_path / "awq"
    quantize_checkpoint(moe.parent / moe.name, path, "awq", group_size=32, skip=["experts"])
    llm = LLM(model=str(path), quantization="fp8", **ENGINE)
    layer = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, LinearBase) and type(layer.quant_method).__name__ == "AwqMethod"
    assert not isinstance(layer.quant_method, UnquantizedLinearMethod)
