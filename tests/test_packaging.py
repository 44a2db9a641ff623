"""Every file a distribution's code reads at run time ships in its wheel: a non-Python file inside a
package (a C kernel compiled at first use, a tuned-config table) must match the distribution's
``[tool.setuptools.package-data]``, or a non-editable install lacks it (the C ops were once missing
from installed wheels and only an editable checkout had them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PROJECTS = [ROOT] + sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))
SKIP_DIRS = {"__pycache__", "tests", "build"}


def data_files(project: Path) -> dict[str, list[Path]]:
    """Non-Python files in each top-level package of a project: {package: [paths relative to it]}."""
    config = tomllib.loads((project / "pyproject.toml").read_text())
    find = config.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
    where = project / find.get("where", ["."])[0]
    found: dict[str, list[Path]] = {}
    for package in where.iterdir():
        if not (package / "__init__.py").exists() or package.name in SKIP_DIRS:
            continue
        for path in package.rglob("*"):
            inner = path.relative_to(package)
            if path.is_file() and path.suffix not in (".py", ".pyc") and not SKIP_DIRS & set(inner.parts):
                found.setdefault(package.name, []).append(inner)
    return found


@pytest.mark.parametrize("project", PROJECTS, ids=lambda p: p.name if p != ROOT else "core")
def test_package_data_ships_every_runtime_file(project):
    config = tomllib.loads((project / "pyproject.toml").read_text())
    globs = config.get("tool", {}).get("setuptools", {}).get("package-data", {})
    missing = [f"{package}/{path}" for package, paths in data_files(project).items() for path in paths
               if not any(path.match(g) for g in globs.get(package, []))]
    assert not missing, f"{project / 'pyproject.toml'}: [tool.setuptools.package-data] lacks {missing}"
