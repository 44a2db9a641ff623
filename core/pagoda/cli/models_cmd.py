"""``pagoda models``: the supported architectures, from the registry (``--markdown`` writes
docs/models.md: ``PAGODA_PLUGINS=models pagoda models --markdown > docs/models.md``).

A model class describes itself with two optional class attributes: ``FEATURES`` (what of
the architecture it implements) and ``TESTED`` (what is proven against transformers);
without ``FEATURES`` the first line of its module's docstring is used.
"""

from __future__ import annotations

MARKDOWN_HEADER = """\
# Supported model architectures

<!-- Generated: `PAGODA_PLUGINS=models pagoda models --markdown > docs/models.md`.
     tests/test_models_docs.py fails when this page and the command's output differ. -->

pagoda picks the model class from the `architectures` list of a checkpoint's `config.json`
(or the GGUF metadata). Model plugins register more architectures through the
`register_models` hook; `pagoda models` lists what is installed.

Every architecture below is compared with HF transformers on tiny random checkpoints written
by `save_pretrained` (`pagoda.testing.make_tiny_checkpoint`): the logits of every prompt
position agree in float32 within 1e-4 (Llama family: 2e-4), absolute and relative (observed
differences are about 1e-6), and greedy decoding of a batch of prompts of different lengths
gives the same tokens for at least 32 new tokens while the engine chunks prefills and
preempts sequences.

| architecture | provider | features | tested against transformers |
| --- | --- | --- | --- |"""


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list supported model architectures")
    p.add_argument("--markdown", action="store_true", help="print the docs/models.md page")
    p.set_defaults(func=run)


def _describe(cls) -> tuple[str, str]:
    module_doc = (__import__(cls.__module__, fromlist=["x"]).__doc__ or "").strip()
    first = " ".join(module_doc.split("\n\n")[0].split()) if module_doc else ""
    features = getattr(cls, "FEATURES", None) or first or (cls.__doc__ or "").strip().split("\n")[0]
    return features, getattr(cls, "TESTED", "")


def architecture_rows() -> list[dict]:
    from pagoda.plugins import get_registry
    from pagoda.registry import resolve_lazy

    reg = get_registry()
    rows = []
    for name in reg.models.names():
        entry = reg.models.entries[name]
        try:
            features, tested = _describe(resolve_lazy(entry.obj))
        except Exception as exc:
            features, tested = f"(fails to import: {exc})", ""
        rows.append({"architecture": name, "provider": entry.provider, "features": features, "tested": tested})
    return sorted(rows, key=lambda r: (r["provider"], r["architecture"]))


def markdown(rows: list[dict]) -> str:
    lines = [MARKDOWN_HEADER]
    for r in rows:
        cells = [f"`{r['architecture']}`", r["provider"], r["features"], r["tested"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    rows = architecture_rows()
    if args.markdown:
        print(markdown(rows), end="")
        return 0
    for r in rows:
        print(f"{r['architecture']:<28} {r['provider']:<14} {r['features']}")
    return 0
