"""docs/models.md is the output of ``pagoda models --markdown`` (pagoda-models only), so the
table of supported architectures never drifts from the registry."""

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
    for arch in ("Phi3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"):
        assert f"`{arch}`" in out
    assert DOC.read_text() == out, ("docs/models.md is stale: regenerate it with "
                                    "`PAGODA_PLUGINS=models pagoda models --markdown > docs/models.md`")
