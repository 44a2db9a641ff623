"""``pagoda quant-sim``: per-layer and overall weight error, logit error, greedy agreement and
memory saved, for a method or a policy file, against full precision."""

import json

import pytest
import yaml
from pagoda.cli.main import main
from pagoda.testing import make_tiny_checkpoint

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, shared_expert_intermediate_size=64)
ARGS = ["--device", "cpu", "--dtype", "float32", "--num-prompts", "3", "--max-tokens", "6"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_tiny_checkpoint("qwen2_moe", tmp_path_factory.mktemp("moe"), seed=3, tokenizer=True, **TINY)


def test_policy_report(moe, tmp_path, capsys):
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"quantization": {
        "default": "fp8", "rules": [{"kind": "experts", "method": "int4", "group_size": 16}]}}))
    out = tmp_path / "report.json"
    assert main(["quant-sim", "--model", str(moe), "--method", str(policy), "--kv-cache-dtype", "fp8",
                 "--json", str(out), *ARGS]) == 0
    text = capsys.readouterr().out
    assert "model.layers.0.mlp.experts" in text and "greedy:" in text and "saves" in text
    report = json.loads(out.read_text())
    layers = report["layers"]
    assert layers["model.layers.1.mlp.experts"]["method"] == "int4"
    assert layers["model.layers.1.self_attn.qkv_proj"]["method"] == "fp8"
    assert layers["model.layers.1.mlp.gate"]["method"] == "none"
    # fp8 keeps about 3 mantissa bits, int4 16 levels per group: the int4 layers are worse
    assert 0.005 < layers["model.layers.1.self_attn.qkv_proj"]["weight_rel_error"] < 0.05
    assert 0.03 < layers["model.layers.1.mlp.experts"]["weight_rel_error"] < 0.2
    overall, memory = report["overall"], report["memory"]
    # per layer: qkv, o, shared expert gate_up and down, experts; kept: router and shared-expert gate
    assert overall["quantized_layers"] == 10 and overall["full_precision_layers"] == 4
    assert 0.0 < overall["logit_rel_error"] < 0.3 and 0.0 <= overall["kl_divergence"] < 0.1
    assert 0.0 <= overall["greedy_token_agreement"] <= 1.0 and 0.5 < overall["top1_agreement"] <= 1.0
    assert 0 < memory["saved_bytes"] < memory["weights_full_bytes"]
    assert memory["kv_bytes_per_token_quantized"] * 4 == memory["kv_bytes_per_token_full"]


def test_random_prompts_without_a_tokenizer_and_method_errors(tmp_path, capsys):
    path = make_tiny_checkpoint("llama", tmp_path / "plain", seed=1, **{k: v for k, v in TINY.items()
                                                                          if "expert" not in k})
    assert main(["quant-sim", "--model", str(path), "--method", "{method: int4, group_size: 32}", *ARGS]) == 0
    assert "model.layers.0.mlp.down_proj" in capsys.readouterr().out
    assert main(["quant-sim", "--model", str(path), "--method", str(tmp_path / "missing.yaml"), *ARGS]) == 1
    assert "policy file does not exist" in capsys.readouterr().err
    assert main(["quant-sim", "--model", str(path), "--method", "{default: fp9}", *ARGS]) == 1
    assert "'fp9' is not registered" in capsys.readouterr().err
