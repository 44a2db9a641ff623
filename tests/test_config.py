"""EngineConfig from YAML, PAGODA_* variables and CLI flags, with errors naming the key."""

import pytest
from pagoda.cli.engine_args import add_engine_args, engine_config_from_args
from pagoda.config import EngineConfig, load_engine_config
from pagoda.errors import ConfigError


def write(tmp_path, text, name="engine.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_precedence_defaults_file_env_arguments(tmp_path, monkeypatch):
    path = write(tmp_path, "max_num_seqs: 4\nblock_size: 32\nenforce_eager: true\n")
    monkeypatch.setenv("PAGODA_BLOCK_SIZE", "8")
    cfg = load_engine_config(path, max_num_seqs=2)
    assert cfg.max_num_seqs == 2  # argument beats file
    assert cfg.block_size == 8  # environment beats file
    assert cfg.enforce_eager is True  # file beats default
    assert cfg.max_num_batched_tokens == EngineConfig().max_num_batched_tokens


def test_engine_section_of_a_serve_file(tmp_path):
    path = write(tmp_path, "engine:\n  max_num_seqs: 3\nserver:\n  port: 9000\n")
    assert load_engine_config(path).max_num_seqs == 3


def test_errors_name_file_key_and_allowed_values(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"engine.yaml: unknown key 'blok_size'; did you mean 'block_size'"):
        load_engine_config(write(tmp_path, "blok_size: 16\n"))
    with pytest.raises(ConfigError, match=r"engine.yaml: key 'dtype'.*float32, float16, bfloat16.*'fp64'"):
        load_engine_config(write(tmp_path, "dtype: fp64\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_engine_config(write(tmp_path, "a: [1, 2\n"))
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_engine_config(write(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_engine_config(str(tmp_path / "missing.yaml"))
    monkeypatch.setenv("PAGODA_MAX_NUM_SEQS", "-1")
    with pytest.raises(ConfigError, match=r"environment \(PAGODA_\*\): key 'max_num_seqs'"):
        load_engine_config()


def test_dtype_may_name_the_device():
    cfg = EngineConfig(dtype="cpu-float32")
    assert cfg.resolved_device_and_dtype() == ("cpu", "float32")
    assert EngineConfig(dtype="bf16").dtype == "bfloat16"
    assert EngineConfig(gpu_memory_utilization=0.5).memory_utilization == 0.5
    with pytest.raises(ConfigError, match="names device 'cuda' but device is 'cpu'"):
        EngineConfig(dtype="cuda-bfloat16", device="cpu").resolved_device_and_dtype()


def test_cli_flags_cover_every_key_and_override_the_file(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {a.dest for a in parser._actions}
    assert set(EngineConfig.model_fields) <= flags
    path = write(tmp_path, "max_num_seqs: 4\nenable_prefix_caching: true\n")
    args = parser.parse_args(["--config", path, "--max-num-seqs", "9", "--no-enable-prefix-caching",
                              "--quantization", "{default: fp8}"])
    cfg = engine_config_from_args(args)
    assert cfg.max_num_seqs == 9 and cfg.enable_prefix_caching is False
    assert cfg.quantization == {"default": "fp8"}


def test_sectioned_file_rejects_unknown_sections(tmp_path):
    with pytest.raises(ConfigError, match="unknown top-level key.*'egnine'"):
        load_engine_config(write(tmp_path, "egnine:\n  max_num_seqs: 3\nserver:\n  port: 1\n"))


def test_step_token_budget_defaults_to_the_platforms(tmp_path):
    from pagoda import LLM
    from pagoda.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint("llama", tmp_path, seed=0, vocab_size=64, hidden_size=16, intermediate_size=32,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                max_position_embeddings=64)
    assert EngineConfig().max_num_batched_tokens is None
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=8, block_size=8)
    assert llm.engine.scheduler.max_num_batched_tokens == 8192
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=8, block_size=8,
              max_num_batched_tokens=24)
    assert llm.engine.scheduler.max_num_batched_tokens == 24
