"""The seed's switches (PAGODA_USE_CAMB=1, --dtype mlu-float16) and `pagoda plugins` on a machine
without torch_mlu: every way of asking for the MLU fails with a message naming torch_mlu."""

import json

import pytest
from mlu_stand_ins import StandInTorchMlu, install_torch_mlu
from pagoda import LLM
from pagoda.cli.main import main
from pagoda.config import EngineConfig
from pagoda.errors import ConfigError, PluginError
from pagoda.plugins import load_plugins
from pagoda.selection import select_platform

NO_TORCH_MLU = "torch_mlu is not importable"


@pytest.fixture
def no_torch_mlu(monkeypatch):
    """A registry whose MLU platform probes a machine where `import torch_mlu` fails."""
    install_torch_mlu(monkeypatch, None, import_error=ImportError("No module named 'torch_mlu'"))
    for var in ("PAGODA_USE_CAMB", "PAGODA_DEVICE", "PAGODA_DTYPE"):
        monkeypatch.delenv(var, raising=False)
    reg = load_plugins()
    monkeypatch.setattr("pagoda.plugins._REGISTRY", reg)
    return reg


def test_env_switch_selects_mlu_and_never_falls_back(no_torch_mlu, monkeypatch):
    monkeypatch.setenv("PAGODA_USE_CAMB", "1")
    with pytest.raises(PluginError) as err:
        LLM(model="unused: the platform is chosen first")
    message = str(err.value)
    assert "device 'mlu' was requested (by PAGODA_USE_CAMB=1) but is unavailable" in message
    assert NO_TORCH_MLU in message and "never falls back to another device" in message


def test_env_switch_off_values_change_nothing(no_torch_mlu, monkeypatch):
    for value in ("0", "false", ""):
        monkeypatch.setenv("PAGODA_USE_CAMB", value)
        assert select_platform("auto", no_torch_mlu).name == "cpu"


def test_env_switch_conflicts_and_bad_values(no_torch_mlu, monkeypatch):
    monkeypatch.setenv("PAGODA_USE_CAMB", "1")
    with pytest.raises(PluginError, match="PAGODA_USE_CAMB=1 selects device 'mlu' but device 'cpu' was requested"):
        select_platform("cpu", no_torch_mlu)
    monkeypatch.setenv("PAGODA_USE_CAMB", "maybe")
    with pytest.raises(PluginError, match=r"PAGODA_USE_CAMB='maybe' is not a switch value: use 1 .* or 0"):
        select_platform("auto", no_torch_mlu)


def test_switch_no_plugin_declares_is_an_error(no_torch_mlu, monkeypatch):
    monkeypatch.setenv("PAGODA_USE_WARP_DRIVE", "1")
    with pytest.raises(PluginError, match=r"PAGODA_USE_WARP_DRIVE=1 asks for a platform, but no installed plugin "
                                          r"declares that switch \(platform switches: PAGODA_USE_CAMB \(mlu\)\)"):
        select_platform("auto", no_torch_mlu)


def test_dtype_names_the_device():
    assert EngineConfig(dtype="mlu-float16").resolved_device_and_dtype() == ("mlu", "float16")
    assert EngineConfig(dtype="mlu-float16", device="mlu").resolved_device_and_dtype() == ("mlu", "float16")
    with pytest.raises(ConfigError, match="dtype 'mlu-float16' names device 'mlu' but device is 'cpu'"):
        EngineConfig(dtype="mlu-float16", device="cpu").resolved_device_and_dtype()


def test_dtype_switch_error_from_the_cli(no_torch_mlu, capsys):
    assert main(["generate", "--dtype", "mlu-float16", "--prompt", "hello"]) == 1
    err = capsys.readouterr().err
    assert "error: device 'mlu' was requested (by dtype 'mlu-float16') but is unavailable" in err
    assert NO_TORCH_MLU in err


def test_both_switches_together(no_torch_mlu, monkeypatch):
    monkeypatch.setenv("PAGODA_USE_CAMB", "1")
    with pytest.raises(PluginError, match=r"\(by PAGODA_USE_CAMB=1 and dtype 'mlu-float16'\) but is unavailable"):
        LLM(dtype="mlu-float16")


def test_switches_reach_a_working_mlu(monkeypatch):
    # STAND-IN torch_mlu with one device that reports no bfloat16: selection and the dtype
    # check happen before anything touches the device, so no MLU is needed.
    install_torch_mlu(monkeypatch, StandInTorchMlu(devices=1, bf16=False))
    reg = load_plugins()
    monkeypatch.setattr("pagoda.plugins._REGISTRY", reg)
    monkeypatch.setenv("PAGODA_USE_CAMB", "1")
    assert select_platform("auto", reg).name == "mlu"
    with pytest.raises(ConfigError, match=r"dtype 'mlu-bfloat16': mlu cannot compute in bfloat16: "
                                          r"torch.mlu.is_bf16_supported\(\) is False"):
        LLM(dtype="mlu-bfloat16")


def test_pagoda_plugins_shows_mlu_unavailable_with_the_reason(no_torch_mlu, capsys):
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    mlu_line = next(line for line in text.splitlines() if line.strip().startswith("mlu ") and "priority" in line)
    assert "pagoda-mlu: unavailable: " + NO_TORCH_MLU in mlu_line
    assert "register_attention_backends: mlu_chunked, mlu_fused" in text
    assert "platform: cpu" in text  # this machine runs on the CPU

    assert main(["plugins", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    (mlu,) = [p for p in info["platforms"] if p["name"] == "mlu"]
    assert mlu["available"] is False and mlu["provider"] == "pagoda-mlu" and NO_TORCH_MLU in mlu["reason"]
    (plugin,) = [p for p in info["plugins"] if p["name"] == "mlu"]
    assert plugin["error"] is None and plugin["registered"]["register_allocators"] == ["mlu-pool"]


def test_tile_size_from_the_command_line():
    import argparse

    from pagoda.cli.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--attention-backend", "mlu_chunked", "--attention-options", "{tile_size: 128}"])
    config = engine_config_from_args(args)
    assert (config.attention_backend, config.attention_options) == ("mlu_chunked", {"tile_size": 128})
