"""``pagoda scaffold model --config config.json --name acme [--out DIR]``: a model plugin to start from.

Writes a plugin distribution ``pagoda-<name>`` for the architecture in ``config.json``:
``pyproject.toml`` with the ``pagoda`` entry point, ``plugin.py`` registering the
architecture, the model file copied from the closest architecture pagoda already supports
(chosen by the config's keys; its class renamed, the modules it builds on copied along), a
transformers config class when transformers does not know the config's ``model_type``,
tests that run ``pagoda check-model`` on a tiny variant of the config, and a README. For an
architecture that computes what the closest one computes (e.g. Llama under a new name) the
package passes its tests as generated; otherwise edit the model file until it does.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
from pathlib import Path

from pagoda.errors import ConfigError

# keys every transformers config has; they say nothing about the architecture
GENERIC_KEYS = {"architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
                "rope_parameters", "rope_scaling", "rope_theta", "auto_map", "quantization_config", "use_cache",
                "id2label", "label2id", "return_dict", "output_attentions", "output_hidden_states",
                "is_encoder_decoder", "problem_type", "chunk_size_feed_forward"}


def add_parser(sub) -> None:
    p = sub.add_parser("scaffold", help="generate a plugin distribution to start from")
    kinds = p.add_subparsers(dest="kind", metavar="KIND")
    m = kinds.add_parser("model", help="a model plugin for the architecture of a config.json",
                         description=__doc__.split("\n\n", 1)[1])
    m.add_argument("--config", required=True, help="the model's config.json")
    m.add_argument("--name", required=True, help="short plugin name, e.g. acme (distribution pagoda-acme)")
    m.add_argument("--out", default=None, help="folder to write (default ./pagoda-<name>)")
    m.add_argument("--force", action="store_true", help="write into an existing non-empty folder")
    m.set_defaults(func=run_model)
    p.set_defaults(func=lambda args: p.print_help() or 2)


# ---------------------------------------------------------------------------- choosing the base
def closest_architecture(config: dict) -> tuple[str, str, float]:
    """(registered architecture, its transformers model type, similarity in [0, 1]) of the
    supported architecture whose transformers config has the most keys in common with
    ``config`` (Jaccard index over the architecture-specific keys)."""
    from transformers import CONFIG_MAPPING

    from pagoda.plugins import get_registry
    from pagoda.testing.tiny import causal_lm_model_type

    wanted = set(config) - GENERIC_KEYS
    best: tuple[str, str, float] | None = None
    for arch in get_registry().models.names():
        model_type = causal_lm_model_type(arch)
        if model_type is None:
            continue
        keys = set(CONFIG_MAPPING[model_type]().to_dict()) - GENERIC_KEYS
        score = len(wanted & keys) / max(1, len(wanted | keys))
        if config.get("model_type") == model_type:
            score = 1.0  # transformers' own model type: that family exactly
        if best is None or score > best[2]:
            best = (arch, model_type, score)
    if best is None:
        raise ConfigError("no supported architecture to start from: install pagoda-models (pagoda plugins lists "
                          "what is installed)")
    return best


def module_source(architecture: str) -> tuple[str, Path]:
    """(module name, source file) of a registered architecture's model class, found without
    importing the module."""
    from pagoda.plugins import get_registry

    target = get_registry().models.entries[architecture].obj
    module = target.partition(":")[0] if isinstance(target, str) else target.__module__
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ConfigError(f"the source of {architecture} ({module}) is not available as a .py file")
    return module, Path(spec.origin)


# ---------------------------------------------------------------------------- rewriting sources
def _local_imports(source: str, package: str) -> list[str]:
    """Modules of ``package`` that ``source`` imports (``from package.x import ...``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package + "."):
            found.append(node.module)
    return found


def _rewrite_imports(source: str, old: str, new: str) -> str:
    return re.sub(rf"\b(from|import)\s+{re.escape(old)}\.", rf"\1 {new}.", source)


def rename_classes(source: str, old_prefix: str, new_prefix: str) -> str:
    """Rename the classes ``source`` defines whose names start with ``old_prefix``."""
    tree = ast.parse(source)
    names = [n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.name.startswith(old_prefix)]
    for name in sorted(names, key=len, reverse=True):
        source = re.sub(rf"\b{re.escape(name)}\b", new_prefix + name[len(old_prefix):], source)
    return source


def set_class_attributes(source: str, class_name: str, attributes: dict[str, str], drop: tuple[str, ...],
                         docstring: str) -> str:
    """Replace the module docstring, drop ``drop`` assignments of ``class_name`` and add
    ``attributes`` (name -> Python expression) at the top of its body."""
    tree = ast.parse(source)
    lines = source.splitlines()
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        raise ConfigError(f"the copied model file defines no class {class_name}")
    cut = [n for n in cls.body if isinstance(n, ast.Assign) and any(getattr(t, "id", "") in drop for t in n.targets)]
    for node in sorted(cut, key=lambda n: n.lineno, reverse=True):
        del lines[node.lineno - 1:node.end_lineno]
    first = next((n for n in cls.body if n not in cut), None)
    indent = " " * (first.col_offset if first is not None else 4)
    at = cls.lineno  # right after the class line (a class docstring stays first: none in pagoda's models)
    if first is not None and isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
        at = first.end_lineno
    lines[at:at] = [f"{indent}{k} = {v}" for k, v in attributes.items()]
    doc = ast.get_docstring(tree, clean=False)
    body = "\n".join(lines) + "\n"
    if doc is not None and isinstance(tree.body[0], ast.Expr):
        end = tree.body[0].end_lineno
        body = f'"""{docstring}"""\n' + "\n".join(body.splitlines()[end:]) + "\n"
    return body


# ---------------------------------------------------------------------------- the package
def camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[-_]", name) if part)


def generate(config_path: Path, name: str, out: Path) -> dict:
    """Write the plugin distribution; returns what was chosen (for the summary)."""
    from transformers import CONFIG_MAPPING

    import pagoda
    from pagoda.plugins import get_registry

    try:
        config = json.loads(config_path.read_text())
    except OSError as exc:
        raise ConfigError(f"--config {config_path}: cannot read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--config {config_path}: not JSON: {exc}") from exc
    archs = config.get("architectures") or []
    if not archs or not isinstance(archs[0], str) or not archs[0].isidentifier():
        raise ConfigError(f"--config {config_path}: 'architectures' must list the model class name, "
                          f"e.g. [\"AcmeForCausalLM\"]")
    if not config.get("model_type"):
        raise ConfigError(f"--config {config_path}: no 'model_type' key")
    arch, model_type = archs[0], config["model_type"]
    reg = get_registry()
    if arch in reg.models:
        raise ConfigError(f"--config {config_path}: architecture {arch} is already provided by "
                          f"{reg.models.entries[arch].provider}; a second plugin registering it would clash")
    base_arch, base_type, score = closest_architecture(config)
    package = f"pagoda_{name.replace('-', '_')}"
    prefix = arch.removesuffix("ForCausalLM") or camel(name)
    base_prefix = base_arch.removesuffix("ForCausalLM")
    modeling = f"modeling_{package.removeprefix('pagoda_')}"
    module, source_file = module_source(base_arch)
    base_package = module.split(".")[0]

    pkg_dir = out / package
    pkg_dir.mkdir(parents=True, exist_ok=True)
    (out / "tests").mkdir(exist_ok=True)
    # the modules the base model builds on, copied as they are (imports pointed at the new package)
    pending, copied = _local_imports(source_file.read_text(), base_package), set()
    while pending:
        dep = pending.pop()
        if dep in copied or dep == module:
            continue
        copied.add(dep)
        dep_text = Path(importlib.util.find_spec(dep).origin).read_text()
        pending += _local_imports(dep_text, base_package)
        (pkg_dir / f"{dep.rsplit('.', 1)[1]}.py").write_text(_rewrite_imports(dep_text, base_package, package))

    needs_config_class = model_type not in CONFIG_MAPPING
    attributes = {
        "FEATURES": repr(f"{arch}, started from {base_arch} of {reg.models.entries[base_arch].provider}"),
        "TESTED": repr("pagoda check-model on a tiny variant of its config.json (tests/test_conformance.py)"),
        "TRANSFORMERS_REFERENCE": repr(base_type),
    }
    if needs_config_class:
        attributes["HF_CONFIG_CLASS"] = repr(f"{package}.configuration:{prefix}Config")
        config_class = CONFIG_MAPPING[base_type].__name__
        _render("configuration.py", pkg_dir / "configuration.py", CONFIG_CLASS=config_class, PREFIX=prefix,
                MODEL_TYPE=model_type, ARCH=arch)
    text = _rewrite_imports(source_file.read_text(), base_package, package)
    text = rename_classes(text, base_prefix, prefix)
    doc = (f"{arch}: the model of pagoda-{name}, started from {base_arch} ({base_package}).\n\n"
           f"Edit it where {arch} differs from {base_arch}; ``pagoda check-model`` compares it with\n"
           f"transformers' {base_type!r} implementation (TRANSFORMERS_REFERENCE below). When the math\n"
           f"differs from every transformers model, compare against your own reference instead.\n")
    text = set_class_attributes(text, arch, attributes, ("FEATURES", "TESTED"), doc)
    (pkg_dir / f"{modeling}.py").write_text(text)
    (pkg_dir / "__init__.py").write_text(f'"""pagoda-{name}: the {arch} model for pagoda."""\n\n'
                                         f'__version__ = "0.1.0"\n')
    fields = dict(NAME=name, DIST=f"pagoda-{name}", PACKAGE=package, ARCH=arch, MODELING=modeling,
                  BASE_ARCH=base_arch, BASE_TYPE=base_type, MODEL_TYPE=model_type, CORE_VERSION=pagoda.__version__)
    _render("plugin.py", pkg_dir / "plugin.py", **fields)
    _render("pyproject.toml", out / "pyproject.toml", **fields)
    _render("README.md", out / "README.md", **fields)
    _render("test_conformance.py", out / "tests" / "test_conformance.py", **fields)
    shutil.copyfile(config_path, out / "tests" / "config.json")
    return {"architecture": arch, "base": base_arch, "reference": base_type, "similarity": score,
            "package": package, "config_class": needs_config_class, "copied": sorted(copied)}


def _render(template: str, dest: Path, **fields: str) -> None:
    from pagoda.cli.scaffold_templates import TEMPLATES

    text = TEMPLATES[template]
    for key, value in fields.items():
        text = text.replace("{{" + key + "}}", str(value))
    leftover = re.search(r"\{\{[A-Z_]+\}\}", text)
    if leftover:
        raise RuntimeError(f"scaffold template {template} has an unfilled field {leftover.group(0)}")
    dest.write_text(text)


def run_model(args) -> int:
    if not re.fullmatch(r"[a-z][a-z0-9_-]*", args.name):
        raise ConfigError(f"--name {args.name!r}: use lowercase letters, digits, '-' or '_', starting with a letter")
    config_path = Path(args.config)
    out = Path(args.out) if args.out else Path.cwd() / f"pagoda-{args.name}"
    if out.exists() and any(out.iterdir()) and not args.force:
        raise ConfigError(f"--out {out}: the folder exists and is not empty (--force writes into it)")
    chosen = generate(config_path, args.name, out)
    print(f"wrote {out}: pagoda-{args.name} registering {chosen['architecture']}")
    print(f"  model file started from {chosen['base']} (key similarity {chosen['similarity']:.2f}), "
          f"checked against transformers {chosen['reference']!r}")
    if chosen["config_class"]:
        print(f"  model_type is unknown to transformers: {chosen['package']}/configuration.py defines its config")
    print(f"next: pip install -e {out} && python -m pytest {out / 'tests'}")
    return 0
