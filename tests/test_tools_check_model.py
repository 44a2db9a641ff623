"""``pagoda check-model``: passes a correct model, fails (exit 1, the failing check named) a
model with wrong logits or incomplete weight loading, checks a checkpoint directory as it is,
and explains bad targets and flags."""

import json

import pytest
from pagoda.cli.main import main
from pagoda.plugins import get_registry
from pagoda.testing import check_kv_cache, expected_kv_bytes_per_token, make_tiny_checkpoint
from pagoda.testing.tiny import shrink_config, variants_for_architecture
from pagoda_models.llama import LlamaForCausalLM
from transformers import AutoConfig


class ScaledLogitsForCausalLM(LlamaForCausalLM):
    """Llama whose logits are 1% too large: greedy tokens may agree, the logits must not."""

    TRANSFORMERS_REFERENCE = "llama"

    def compute_logits(self, hidden):
        return super().compute_logits(hidden) * 1.01


class PartialLoadForCausalLM(LlamaForCausalLM):
    """Llama whose load_weights stops reading at the second layer."""

    TRANSFORMERS_REFERENCE = "llama"

    def load_weights(self, weights):
        def until_layer_one():
            for name, tensor in weights:
                if ".layers.1." in name:
                    return
                yield name, tensor

        return super().load_weights(until_layer_one())


@pytest.fixture
def registered():
    reg = get_registry()
    added = []

    def add(name, cls):
        reg.models.add(name, cls, "tests")
        added.append(name)

    yield add
    for name in added:
        reg.models.entries.pop(name, None)


def _json_report(capsys, argv):
    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


def test_a_correct_model_passes_every_check(capsys):
    code, report = _json_report(capsys, ["check-model", "Qwen3ForCausalLM", "--variant", "gqa", "--json"])
    assert code == 0 and report["passed"]
    assert report["reference"] == "qwen3"
    (variant,) = report["variants"]
    checks = {c["check"]: c for c in variant["checks"]}
    assert set(checks) == {"weights", "prompt_logits", "kv_cache", "greedy"}
    assert all(c["passed"] for c in checks.values())
    assert checks["prompt_logits"]["metrics"]["max_abs_diff"] < 1e-4
    assert checks["greedy"]["metrics"]["preemptions"] > 0
    assert checks["weights"]["metrics"]["unread"] == [] and checks["weights"]["metrics"]["missing"] == []
    # gqa variant: 2 layers x (K, V) x 2 KV heads x head_dim 32 (explicit, not hidden/heads) x 4 bytes
    assert checks["kv_cache"]["metrics"]["bytes_per_token"] == 2 * 2 * 2 * 32 * 4


@pytest.mark.parametrize("architecture,variant", [
    ("Gemma2ForCausalLM", "window"), ("Gemma3ForCausalLM", "window"), ("MixtralForCausalLM", "gqa"),
    ("GptOssForCausalLM", "window"), ("DeepseekV32ForCausalLM", "base")])
def test_issue18_architectures_pass(capsys, architecture, variant):
    """The architectures of issue 18 on the variant that exercises the most of them (a sliding-window
    layer next to a global one; DeepSeek-V3.2's top-k indexer); the other variants pass too
    (``pagoda check-model <architecture>``, docs/models.md)."""
    code, report = _json_report(capsys, ["check-model", architecture, "--variant", variant, "--json"])
    failed = [c for v in report["variants"] for c in v["checks"] if not c["passed"]]
    assert code == 0 and not failed, failed


def test_layered_window_models_get_global_and_mixed_variants():
    names = {v.name: v.fields for v in variants_for_architecture("Gemma3ForCausalLM")}
    assert names["gqa"]["layer_types"] == ["full_attention"] * 2 and names["gqa"]["sliding_window"] == 24
    assert names["window"]["layer_types"] == ["sliding_attention", "full_attention"]


def test_wrong_logits_fail_with_exit_1(capsys, registered):
    registered("ScaledLogitsForCausalLM", ScaledLogitsForCausalLM)
    code, report = _json_report(capsys, ["check-model", "ScaledLogitsForCausalLM", "--variant", "gqa",
                                         "--checks", "prompt_logits,kv_cache", "--json"])
    assert code == 1 and not report["passed"]
    checks = {c["check"]: c for c in report["variants"][0]["checks"]}
    assert not checks["prompt_logits"]["passed"] and "prompt 0" in checks["prompt_logits"]["detail"]
    assert checks["kv_cache"]["passed"]


def test_unread_tensors_and_missing_parameters_are_named(capsys, registered):
    registered("PartialLoadForCausalLM", PartialLoadForCausalLM)
    assert main(["check-model", "PartialLoadForCausalLM", "--variant", "gqa", "--checks", "weights"]) == 1
    table = capsys.readouterr().out
    assert "FAIL" in table and "never read by load_weights: model.layers.1." in table
    assert "parameters not loaded: model.layers.1." in table
    assert "1 checks FAILED" in table


def test_a_checkpoint_directory_is_checked_as_it_is(capsys, tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "ckpt", seed=2, vocab_size=320, hidden_size=64,
                                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=256)
    code, report = _json_report(capsys, ["check-model", str(path), "--checks", "weights,prompt_logits", "--json"])
    assert code == 0
    assert [v["variant"] for v in report["variants"]] == ["checkpoint"]
    assert report["variants"][0]["checkpoint"] == str(path)


def test_bad_targets_and_flags_are_explained(capsys, tmp_path):
    assert main(["check-model", "NoSuchForCausalLM"]) == 1
    err = capsys.readouterr().err
    assert "NoSuchForCausalLM is not supported" in err and "has no causal-LM class named NoSuchForCausalLM" in err
    assert main(["check-model", "LlamaForCausalLM", "--variant", "huge"]) == 1
    assert "--variant huge: LlamaForCausalLM has variants gqa, mha-tied" in capsys.readouterr().err
    assert main(["check-model", "LlamaForCausalLM", "--checks", "speed"]) == 1
    assert "unknown check speed" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["check-model", str(tmp_path)]) == 1
    assert "no 'architectures' list" in capsys.readouterr().err


def test_tiny_variants_keep_the_settings_that_change_the_math():
    names = {v.name: v.fields for v in variants_for_architecture("Qwen2ForCausalLM")}
    assert set(names) == {"gqa", "mha-tied", "window"}
    assert names["mha-tied"]["num_key_value_heads"] == 4 and names["mha-tied"]["tie_word_embeddings"]
    assert names["window"]["sliding_window"] == 24 and names["window"]["use_sliding_window"]
    fields = shrink_config({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                            "rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 4096,
                                             "short_factor": [1.0] * 64, "long_factor": [2.0] * 64},
                            "bos_token_id": 128000, "attention_bias": True, "n_group": 8, "n_routed_experts": 256})
    assert fields["hidden_size"] == 64 and fields["num_key_value_heads"] == 2 and fields["attention_bias"]
    assert fields["rope_scaling"]["original_max_position_embeddings"] == 64
    assert len(fields["rope_scaling"]["long_factor"]) == fields["head_dim"] // 2
    assert fields["bos_token_id"] < 320
    assert (fields["n_group"], fields["topk_group"], fields["n_routed_experts"]) == (4, 2, 16)
    partial = shrink_config({"hidden_size": 3072, "num_attention_heads": 24, "partial_rotary_factor": 0.75,
                             "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48,
                                              "short_factor": [1.0] * 48}})
    assert len(partial["rope_scaling"]["short_factor"]) == int(16 * 0.75) // 2  # head_dim 64 / 4 heads


def test_kv_bytes_the_architecture_implies():
    gqa = AutoConfig.for_model("llama", num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                               hidden_size=256)
    assert expected_kv_bytes_per_token(gqa, 2) == 3 * 2 * 2 * 32 * 2
    mla = AutoConfig.for_model("deepseek_v3", num_hidden_layers=4, kv_lora_rank=512, qk_rope_head_dim=64)
    assert expected_kv_bytes_per_token(mla, 2) == 4 * (512 + 64) * 2
    sparse = AutoConfig.for_model("deepseek_v32", num_hidden_layers=4, kv_lora_rank=512, qk_rope_head_dim=64,
                                  index_head_dim=128)
    assert expected_kv_bytes_per_token(sparse, 2) == 4 * (512 + 64 + 128) * 2  # the index key is cached too


def test_kv_check_fails_on_a_wrong_size(tmp_path):
    from pagoda import LLM

    path = make_tiny_checkpoint("llama", tmp_path / "ckpt", vocab_size=320, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=64)
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=8, block_size=8)
    assert check_kv_cache(llm).passed
    wrong = check_kv_cache(llm, expected=999)
    assert not wrong.passed and "512 bytes per token, the architecture implies 999" in wrong.detail
    with pytest.raises(AssertionError, match="kv_cache: 512 bytes per token"):
        wrong.assert_passed()
