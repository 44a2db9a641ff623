"""``pagoda models``: the supported architectures, from the registry (``--markdown`` for docs)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list supported model architectures")
    p.add_argument("--markdown", action="store_true", help="print the docs/models.md table")
    p.set_defaults(func=run)


def architecture_rows() -> list[dict]:
    from pagoda.plugins import get_registry
    from pagoda.registry import resolve_lazy

    reg = get_registry()
    rows = []
    for name in reg.models.names():
        entry = reg.models.entries[name]
        try:
            cls = resolve_lazy(entry.obj)
            doc = (cls.__doc__ or cls.__module__.__doc__ or "").strip().splitlines()
            module_doc = (__import__(cls.__module__, fromlist=["x"]).__doc__ or "").strip().splitlines()
            features = getattr(cls, "FEATURES", None) or (module_doc[0] if module_doc else (doc[0] if doc else ""))
            tested = getattr(cls, "TESTED", "")
        except Exception as exc:
            features, tested = f"(fails to import: {exc})", ""
        rows.append({"architecture": name, "provider": entry.provider, "features": features, "tested": tested})
    return rows


def run(args) -> int:
    rows = architecture_rows()
    if args.markdown:
        print("| architecture | provider | features | tested against transformers |")
        print("| --- | --- | --- | --- |")
        for r in rows:
            print(f"| `{r['architecture']}` | {r['provider']} | {r['features']} | {r['tested']} |")
        return 0
    for r in rows:
        print(f"{r['architecture']:<28} {r['provider']:<14} {r['features']}")
    return 0
