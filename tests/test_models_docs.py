"""docs/models.md is the output of ``pagoda models --markdown`` (pagoda-models and the core's transformers
fallback), so the tables of supported architectures never drift from the registry."""

from pathlib import Path

from pagoda.cli.main import main
from pagoda.plugins import reset_registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"


def test_models_doc_is_the_commands_output(monkeypatch, capsys):
    monkeypatch.setenv("PAGODA_PLUGINS", "models")
    reset_registry()
    try:
        assert main(["models", "--markdown"]) == 0
        out = capsys.readouterr().out
    finally:
        monkeypatch.delenv("PAGODA_PLUGINS")
        reset_registry()
    native, fallback = out.split("## Through transformers")
    for arch in ("Phi3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"):
        assert f"| `{arch}` | pagoda-models |" in native and f"`{arch}`" not in fallback  # a native class wins
    for arch in ("Olmo2ForCausalLM", "GraniteForCausalLM", "StableLmForCausalLM", "CohereForCausalLM"):
        row = next(line for line in fallback.splitlines() if line.startswith(f"| `{arch}` |"))
        assert "| pagoda-core (via transformers) |" in row and "| tested: " in row  # tested, and says what
    assert "`MambaForCausalLM`" not in out  # no attention layers: not run by the fallback
    assert DOC.read_text() == out, ("docs/models.md is stale: regenerate it with "
                                    "`PAGODA_PLUGINS=models pagoda models --markdown > docs/models.md`")
