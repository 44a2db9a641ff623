"""``pagoda config``: the resolved EngineConfig (file + environment + flags), or its key reference."""

from __future__ import annotations

import json

from pagoda.cli.engine_args import add_engine_args, engine_config_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("config", help="show the resolved engine configuration, or --markdown reference")
    p.add_argument("--markdown", action="store_true", help="print the docs/configuration.md key table")
    add_engine_args(p)
    p.set_defaults(func=run)


def markdown_table() -> str:
    from pagoda.config import EngineConfig

    lines = ["| key | flag | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in EngineConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        value = field.default_factory() if field.default_factory is not None else field.default
        default = json.dumps(value)
        lines.append(f"| `{name}` | `{flag}` | `{default}` | {field.description or ''} |")
    return "\n".join(lines)


def run(args) -> int:
    if args.markdown:
        print(markdown_table())
        return 0
    print(json.dumps(engine_config_from_args(args).model_dump(), indent=2))
    return 0
