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
from pagoda.selection import (
    get_logits_processor,
    get_reasoning_parser,
    get_tool_parser,
    resolve_model_class,
    select_attention_backend,
    select_platform,
    select_reasoning_parser,
    select_tool_parser,
)

HERE = Path(__file__).parent / "plugins"
DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """pip-install the four test plugins into separate folders (a real install with metadata)."""
    dirs = {}
    for name in ("dummy", "broken", "dup", "dupparser"):
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
    plugin_docs = (DOCS / "plugins.md").read_text()
    for hook in HOOKS:
        doc = getattr(hookspecs, hook).__doc__
        assert doc and "register(" in doc, hook
        assert f"`{hook}`" in plugin_docs, f"docs/plugins.md does not document {hook}"


def test_every_interface_and_its_attributes_are_documented():
    """What a plugin implements or reads (pagoda.interfaces) is named in docs/plugins.md: each class, and
    each public attribute and method it declares."""
    import inspect

    from pagoda import interfaces

    plugin_docs = (DOCS / "plugins.md").read_text()
    missing = []
    for name, cls in vars(interfaces).items():
        if name.startswith("_") or not inspect.isclass(cls) or cls.__module__ != interfaces.__name__:
            continue
        if f"`{name}" not in plugin_docs and f".{name}`" not in plugin_docs:
            missing.append(name)
        for attr in dict.fromkeys([*vars(cls), *getattr(cls, "__annotations__", {})]):
            if not attr.startswith("_") and f"`{attr}" not in plugin_docs:
                missing.append(f"{name}.{attr}")
    assert not missing, f"docs/plugins.md does not name: {', '.join(missing)}"


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
    assert reg.tool_parsers.entries["dummy_lines"].provider == "pagoda-dummy-plugin"
    assert info.registered["register_tool_parsers"] == ["dummy_lines", "dummy_missing"]
    assert info.registered["register_reasoning_parsers"] == ["dummy_bang"]
    assert info.registered["register_logits_processors"] == ["dummy_ban"]


def test_parsers_and_processors_are_selected_by_name(with_plugins):
    import torch

    reg = with_plugins("dummy")
    # a third-party parser that implements only extract() still streams (held to the end)
    parser = get_tool_parser("dummy_lines", reg)(None, tools=[], id_factory=lambda i: f"c{i}")
    stream = parser.stream()
    assert stream.feed("Hi\nCALL f {\"a\": 1}\n") == []
    deltas = stream.feed("CALL g", done=True)
    from pagoda.parsers import ToolCallResult

    assert ToolCallResult.from_deltas(deltas) == parser.extract('Hi\nCALL f {"a": 1}\nCALL g')
    assert [c.name for c in parser.extract('CALL f {}').calls] == ["f"]
    reasoning = get_reasoning_parser("dummy_bang", reg)(None)  # a lazy "module:Class" registration
    assert reasoning.extract("hmm!!yes") == ("hmm", "yes")
    assert reasoning.stream().feed("hm", done=False) == (None, None)
    processor = get_logits_processor("dummy_ban", reg)(8, None)
    assert torch.isinf(processor([1, 2], torch.zeros(8))[3])
    # the built-in ones, by name and from a chat template
    assert get_tool_parser("hermes", reg).__name__ == "HermesToolParser"
    assert select_tool_parser("auto", "<|im_start|>{{ '<tool_call>' }} \"arguments\"", reg).__name__ == \
        "HermesToolParser"
    assert select_tool_parser("auto", "no markers here", reg) is None
    assert select_tool_parser("none", None, reg) is None
    assert select_reasoning_parser("auto", "<|im_start|> <think>", reg).__name__ == "Qwen3ReasoningParser"


def test_unknown_parser_or_processor_names_the_flag_and_what_is_registered(with_plugins):
    reg = with_plugins("dummy")
    with pytest.raises(PluginError, match=r"tool_call_parser \(--tool-call-parser\): tool parser 'nosuch' is "
                                          r"not registered \(registered: .*dummy_lines.*hermes"):
        get_tool_parser("nosuch", reg)
    with pytest.raises(PluginError, match=r"reasoning_parser \(--reasoning-parser\).*registered: .*qwen3"):
        get_reasoning_parser("nosuch", reg)
    with pytest.raises(PluginError, match=r"logits_processors \(--logits-processors\).*registered: dummy_ban"):
        get_logits_processor("nosuch", reg)
    with pytest.raises(PluginError, match="registered by pagoda-dummy-plugin but failed to import"):
        get_tool_parser("dummy_missing", reg)


def test_registering_something_that_is_not_a_class_is_reported():
    from pagoda.plugins import PluginRegistry, _make_register
    from pagoda.registry import PluginInfo

    reg = PluginRegistry()
    register = _make_register("register_tool_parsers", reg, "pagoda-acme", PluginInfo("acme", "pagoda-acme", "1"))
    with pytest.raises(PluginError, match="pagoda-acme registered tool parser 'x' as 3: register a class"):
        register("x", 3)


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
    with pytest.raises(PluginError, match="tool parser 'hermes' is registered twice: by pagoda-core and by "
                                          "pagoda-dupparser-plugin"):
        with_plugins("dupparser", allow="dupparser")


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
    assert info["tool_parsers"]["hermes"] == "pagoda-core" and info["tool_parsers"]["dummy_lines"] == \
        "pagoda-dummy-plugin"
    assert info["reasoning_parsers"]["qwen3"] == "pagoda-core"
    assert info["logits_processors"] == {"dummy_ban": "pagoda-dummy-plugin"}
    assert plugins["dummy"]["registered"]["register_logits_processors"] == ["dummy_ban"]
    text = subprocess.run([sys.executable, "-m", "pagoda.cli.main", "plugins"], env=env, capture_output=True,
                          text=True, check=True).stdout
    assert "FAILED" in text and "pagoda-dummy-plugin 1.2.3" in text
    assert "register_tool_parsers: dummy_lines, dummy_missing" in text
    assert "logits processors: dummy_ban [pagoda-dummy-plugin]" in text


def test_named_backend_applies_to_the_kinds_it_implements():
    from pagoda.interfaces import AttentionSpec

    reset_registry()
    cpu = select_platform("cpu")
    mla = AttentionSpec("mla", 4, 1, 48, 0.2, kv_lora_rank=32, qk_rope_head_dim=16)
    chosen = select_attention_backend("torch", cpu, "float32", mla)  # torch is MHA-only
    assert "mla" in chosen.kinds
