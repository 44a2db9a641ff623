"""``pagoda bench <kind>``: throughput and latency (offline engine), serve (a running server)."""

from __future__ import annotations

import importlib

# modules with add_parser(subparsers) for one benchmark each
BENCH_MODULES = ["pagoda.bench.throughput", "pagoda.bench.latency", "pagoda.bench.serve", "pagoda.bench.embed"]


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: throughput, latency, serve, embed")
    bench_sub = p.add_subparsers(dest="bench", metavar="KIND")
    for name in BENCH_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.add_parser(bench_sub)
    p.set_defaults(func=lambda args: p.print_help() or 2)
