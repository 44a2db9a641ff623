"""Generated documentation stays in sync with the code that generates it."""

from pathlib import Path

from pagoda.cli.config_cmd import markdown_table

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_configuration_reference_is_current():
    text = (DOCS / "configuration.md").read_text()
    assert markdown_table().strip() in text, "regenerate with: pagoda config --markdown"
