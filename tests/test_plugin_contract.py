"""The plugin contract: entry-point discovery of real installed distributions, duplicates,
broken plugins, the PAGODA_PLUGINS allowlist, and selection without silent fallback."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pagoda import hookspecs
from pagoda.errors import ModelLoadError, PluginError
from pagoda.plugins import HOOKS, load_plugins, reset_registry
from pagoda.selection import resolve_model_class, select_attention_backend, select_platform

HERE = Path(__file__).parent / "plugins"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """pip-install the three test plugins into separate folders (a real install with metadata)."""
    dirs = {}
    for name in ("dummy", "broken", "dup"):
        target = tmp_path_factory.mktemp(f"site-{name}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "--target", str(target), str(HERE / name)], check=True,
                       capture_output=True)
        dirs[name] = target
    return dirs


@pytest.fixture
def with_plugins(site, monkeypatch):
    def use(*names, allow=None):
        for name in names:
            monkeypatch.syspath_prepend(str(site[name]))
        if allow is None:
            monkeypatch.delenv("PAGODA_PLUGINS", raising=False)
        else:
            monkeypatch.setenv("PAGODA_PLUGINS", allow)
        reset_registry()
        return load_plugins()

    yield use
    reset_registry()


def test_every_hook_is_documented():
    for hook in HOOKS:
        doc = getattr(hookspecs, hook).__doc__
        assert doc and "register(" in doc, hook


def test_installed_plugin_registers_under_every_hook(with_plugins):
    reg = with_plugins("dummy")
    info = next(p for p in reg.plugins if p.name == "dummy")
    assert info.distribution == "pagoda-dummy-plugin" and info.version == "1.2.3" and info.error is None
    assert set(info.registered) == set(HOOKS)
    assert reg.platforms.entries["dummy"].provider == "pagoda-dummy-plugin"
    assert "DummyForCausalLM" in reg.models and "dummy_quant" in reg.quantizers
    assert "dummy_allocator" in reg.allocators and "dummy_attention" in reg.attention_backends
    # the kernel is chosen for its platform only; the CPU keeps the core's reference
    fn, provider = reg.kernels.select("rms_norm", "dummy")
    assert provider == "pagoda-dummy-plugin" and fn.__name__ == "scaled_rms_norm"
    assert reg.kernels.select("rms_norm", "cpu")[1] == "pagoda-core"


def test_unavailable_platform_is_an_error_never_a_fallback(with_plugins):
    reg = with_plugins("dummy")
    with pytest.raises(PluginError, match="dummylib"):
        select_platform("dummy", reg)
    assert select_platform("auto", reg).name == "cpu"  # auto skips what is unavailable
    with pytest.raises(PluginError, match="not a registered platform"):
        select_platform("tpu", reg)


def test_explicit_backend_that_cannot_run_is_an_error(with_plugins):
    from pagoda.interfaces import AttentionSpec

    reg = with_plugins("dummy", allow="dummy")  # pagoda-cuda's entry point is not loaded
    spec = AttentionSpec("mha", 4, 2, 16, 0.25)
    cpu = select_platform("cpu", reg)
    with pytest.raises(PluginError, match="runs on dummy"):
        select_attention_backend("dummy_attention", cpu, "float32", spec, reg)
    with pytest.raises(PluginError, match="provided by pagoda-cuda"):
        select_attention_backend("triton", cpu, "float32", spec, reg)
    assert select_attention_backend("auto", cpu, "float32", spec, reg).name in reg.attention_backends.names()


def test_plugin_that_fails_to_import_is_reported_and_skipped(with_plugins):
    reg = with_plugins("dummy", "broken")
    broken = next(p for p in reg.plugins if p.name == "broken")
    assert broken.distribution == "pagoda-broken-plugin"
    assert "not_an_installed_device_library" in broken.error
    assert "dummy" in reg.platforms  # the others still load
    note = reg.failure_note()
    assert "broken (pagoda-broken-plugin)" in note


def test_failed_plugin_is_named_when_what_it_would_provide_is_required(with_plugins):
    reg = with_plugins("broken", allow="broken")
    with pytest.raises(ModelLoadError) as err:
        resolve_model_class(["LlamaForCausalLM"], "model dir", reg)
    assert "pagoda-models" in str(err.value) and "broken (pagoda-broken-plugin)" in str(err.value)


def test_duplicate_names_are_rejected_naming_both_distributions(with_plugins):
    with pytest.raises(PluginError) as err:
        with_plugins("dup")
    assert "pagoda-core" in str(err.value) and "pagoda-dup-plugin" in str(err.value)


def test_allowlist_loads_only_named_plugins(with_plugins):
    reg = with_plugins("dummy", "broken", allow="dummy")
    names = {p.name for p in reg.plugins}
    assert names == {"core", "dummy"}
    assert "LlamaForCausalLM" not in reg.models
    reg = with_plugins("dummy", allow="dummy,nosuch")
    missing = next(p for p in reg.plugins if p.name == "nosuch")
    assert "PAGODA_PLUGINS" in missing.error


def test_pagoda_plugins_command_lists_everything(site):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site["dummy"]), str(site["broken"])]))
    env.pop("PAGODA_PLUGINS", None)
    proc = subprocess.run([sys.executable, "-m", "pagoda.cli.main", "plugins", "--json"], env=env,
                          capture_output=True, text=True, check=True)
    info = json.loads(proc.stdout)
    plugins = {p["name"]: p for p in info["plugins"]}
    assert plugins["dummy"]["version"] == "1.2.3"
    assert plugins["broken"]["error"]
    assert plugins["models"]["registered"]["register_models"]
    dummy = next(p for p in info["platforms"] if p["name"] == "dummy")
    assert dummy["available"] is False and "dummylib" in dummy["reason"]
    assert info["selected"]["platform"] in ("cpu", "cuda")
    text = subprocess.run([sys.executable, "-m", "pagoda.cli.main", "plugins"], env=env, capture_output=True,
                          text=True, check=True).stdout
    assert "FAILED" in text and "pagoda-dummy-plugin 1.2.3" in text


def test_named_backend_applies_to_the_kinds_it_implements():
    from pagoda.interfaces import AttentionSpec

    reset_registry()
    cpu = select_platform("cpu")
    mla = AttentionSpec("mla", 4, 1, 48, 0.2, kv_lora_rank=32, qk_rope_head_dim=16)
    chosen = select_attention_backend("torch", cpu, "float32", mla)  # torch is MHA-only
    assert "mla" in chosen.kinds
