"""``pagoda <command>``: each command lives in its own module with ``add_parser``."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from pagoda.errors import PagodaError

# Modules defining add_parser(subparsers); a command whose module fails to import (its
# optional dependency missing) is listed with the reason instead of breaking the CLI.
COMMAND_MODULES = [
    "pagoda.cli.plugins_cmd",
    "pagoda.cli.generate",
    "pagoda.cli.embed_cmd",
    "pagoda.cli.models_cmd",
    "pagoda.cli.config_cmd",
    "pagoda.cli.bench",
    "pagoda.cli.serve",
    "pagoda.cli.quant_sim",
    "pagoda.cli.check_model",
    "pagoda.cli.scaffold",
    "pagoda.cli.perf_diff",
    "pagoda.cli.attention_map",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="pagoda: LLM inference and serving")
    parser.add_argument("--log-level", default=os.environ.get("PAGODA_LOG_LEVEL", "WARNING"),
                        help="DEBUG, INFO, WARNING (default), ERROR")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # not written yet / not shipped in this build
                continue
            name = module_name.rsplit(".", 1)[-1].removesuffix("_cmd").replace("_", "-")
            p = sub.add_parser(name, help=f"(unavailable: {exc})")
            p.set_defaults(func=_unavailable(name, exc))
            continue
        except ImportError as exc:
            name = module_name.rsplit(".", 1)[-1].removesuffix("_cmd").replace("_", "-")
            p = sub.add_parser(name, help=f"(unavailable: {exc})")
            p.set_defaults(func=_unavailable(name, exc))
            continue
        module.add_parser(sub)
    return parser


def _unavailable(name: str, exc: Exception):
    def run(args) -> int:
        print(f"pagoda {name} is unavailable: {exc}", file=sys.stderr)
        return 2

    return run


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except PagodaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
