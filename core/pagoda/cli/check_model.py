"""``pagoda check-model ARCH_OR_DIR``: the conformance harness of a model plugin.

Checks pagoda against transformers on tiny random variants of an architecture (or on a
checkpoint): prompt logits within tolerance, identical greedy tokens through continuous
batching with chunked prefill and preemption, every checkpoint tensor read and every
parameter loaded, KV cache bytes per token as the architecture implies. Prints a table
(``--json``: the report as JSON) and exits 1 when any check fails.
"""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    from pagoda.testing.harness import CHECKS

    p = sub.add_parser("check-model", help="check a model plugin against transformers (conformance harness)",
                       description=__doc__.split("\n\n", 1)[1])
    p.add_argument("target", metavar="ARCH_OR_DIR",
                   help="an architecture name (e.g. LlamaForCausalLM), a config.json (or a directory with only "
                        "one), or a checkpoint directory")
    p.add_argument("--variant", action="append", default=None, metavar="NAME",
                   help="run only this tiny variant (repeatable; e.g. gqa, mha-tied, window)")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    p.add_argument("--atol", type=float, default=1e-4, help="absolute logit tolerance (default 1e-4)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative logit tolerance (default 1e-4)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--keep", metavar="DIR", default=None, help="write the tiny checkpoints here and keep them")
    p.add_argument("--model-impl", default="auto", choices=("auto", "pagoda", "transformers"),
                   help="which implementation to check: auto (native if registered, else the transformers "
                        "fallback), pagoda (native only) or transformers (the fallback, also for native architectures)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from pagoda.errors import ConfigError
    from pagoda.testing.harness import check_model

    if args.max_tokens < 1:
        raise ConfigError("--max-tokens must be >= 1")
    checks = tuple(c.strip() for c in args.checks.split(",") if c.strip())
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per tiny checkpoint written and read drowns the table
    report = check_model(args.target, variants=args.variant, checks=checks, workdir=args.keep, atol=args.atol,
                         rtol=args.rtol, max_tokens=args.max_tokens, seed=args.seed, model_impl=args.model_impl)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(report.table())
    return 0 if report.passed else 1
