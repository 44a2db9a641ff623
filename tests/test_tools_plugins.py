"""Third-party model plugins: the minimal example plugin and a ``pagoda scaffold model``
package are pip-installed (real installs with entry-point metadata) and pass check-model."""

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from pagoda.cli.main import main
from pagoda.cli.scaffold import closest_architecture
from pagoda.plugins import get_registry, reset_registry

ROOT = Path(__file__).resolve().parents[1]
# a Llama-3.2-1B-like config under a name and model type transformers does not know
ACME = {"architectures": ["AcmeForCausalLM"], "model_type": "acme", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
        "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256}


def pip_install(source: Path, target: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(target), str(source)], check=True, capture_output=True)


@pytest.fixture
def fresh_registry():
    reset_registry()
    yield
    reset_registry()


def test_minimal_plugin_installs_and_passes_check_model(tmp_path, monkeypatch, capsys, fresh_registry):
    source = tmp_path / "src"
    shutil.copytree(ROOT / "examples" / "minimal_plugin", source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    pip_install(source, tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delenv("PAGODA_PLUGINS", raising=False)
    reset_registry()
    assert get_registry().models.entries["GraniteForCausalLM"].provider == "pagoda-granite"
    from pagoda.selection import resolve_model_class

    assert resolve_model_class(["GraniteForCausalLM"], "x").__module__.startswith("pagoda_granite")  # native wins
    code = main(["check-model", "GraniteForCausalLM", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"], report
    assert report["reference"] == "granite"
    assert [v["variant"] for v in report["variants"]] == ["gqa", "mha-tied"]


def test_scaffolded_package_installs_and_its_generated_tests_pass(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(ACME))
    out = tmp_path / "pagoda-acme"
    assert main(["scaffold", "model", "--config", str(config), "--name", "acme", "--out", str(out)]) == 0
    assert "started from LlamaForCausalLM" in capsys.readouterr().out
    project = tomllib.loads((out / "pyproject.toml").read_text())
    assert project["project"]["name"] == "pagoda-acme"
    assert project["project"]["entry-points"]["pagoda"] == {"acme": "pagoda_acme.plugin"}
    model_file = (out / "pagoda_acme" / "modeling_acme.py").read_text()
    assert "class AcmeForCausalLM(nn.Module):" in model_file and "class AcmeDecoderLayer(" in model_file
    assert "class Llama" not in model_file
    assert "TRANSFORMERS_REFERENCE = 'llama'" in model_file
    assert "HF_CONFIG_CLASS = 'pagoda_acme.configuration:AcmeConfig'" in model_file
    assert json.loads((out / "tests" / "config.json").read_text()) == ACME

    pip_install(out, tmp_path / "site")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"), OMP_NUM_THREADS="1")
    env.pop("PAGODA_PLUGINS", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(out / "tests")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout


def test_scaffold_starts_from_the_closest_architecture(tmp_path, monkeypatch, capsys):
    moe = {"architectures": ["MyMoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
           "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True}
    assert closest_architecture(moe)[:2] == ("Qwen3MoeForCausalLM", "qwen3_moe")
    mla = {"architectures": ["KimiLikeForCausalLM"], "model_type": "kimi_like", "kv_lora_rank": 512,
           "q_lora_rank": 1536, "qk_rope_head_dim": 64, "n_routed_experts": 64, "n_group": 1, "topk_group": 1,
           "first_k_dense_replace": 1, "routed_scaling_factor": 2.4, "v_head_dim": 128, "qk_nope_head_dim": 128}
    assert closest_architecture(mla)[0] == "DeepseekV3ForCausalLM"
    assert closest_architecture({"model_type": "phi3", "hidden_size": 3072})[0] == "Phi3ForCausalLM"

    config = tmp_path / "config.json"
    config.write_text(json.dumps(moe))
    out = tmp_path / "pkg"
    assert main(["scaffold", "model", "--config", str(config), "--name", "mymoe", "--out", str(out)]) == 0
    # the base module and what it builds on are copied, imports pointed at the new package
    assert sorted(p.name for p in (out / "pagoda_mymoe").glob("*.py")) == [
        "__init__.py", "llama.py", "modeling_mymoe.py", "plugin.py", "qwen2_moe.py"]
    assert "from pagoda_models" not in "".join(p.read_text() for p in (out / "pagoda_mymoe").glob("*.py"))
    monkeypatch.syspath_prepend(str(out))
    module = importlib.import_module("pagoda_mymoe.modeling_mymoe")
    cls = module.MyMoeForCausalLM
    assert cls.TRANSFORMERS_REFERENCE == "qwen3_moe" and not hasattr(cls, "HF_CONFIG_CLASS")
    assert [c.__name__ for c in cls.__mro__[1:3]] == ["Qwen2MoeForCausalLM", "LlamaForCausalLM"]
    assert cls.__mro__[1].__module__ == "pagoda_mymoe.qwen2_moe"


def test_scaffold_explains_bad_input(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama"}))
    assert main(["scaffold", "model", "--config", str(config), "--name", "x", "--out", str(tmp_path / "a")]) == 1
    assert "'architectures' must list the model class name" in capsys.readouterr().err
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    assert main(["scaffold", "model", "--config", str(config), "--name", "x", "--out", str(tmp_path / "b")]) == 1
    assert "LlamaForCausalLM is already provided by pagoda-models" in capsys.readouterr().err
    assert main(["scaffold", "model", "--config", str(config), "--name", "Bad Name"]) == 1
    assert "--name 'Bad Name'" in capsys.readouterr().err
    assert main(["scaffold", "model", "--config", str(tmp_path), "--name", "x", "--out", str(tmp_path)]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
