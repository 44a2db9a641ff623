"""``pagoda embed``: embeddings, scores or class probabilities of prompts, offline, with a pooling
model (the engine runs with ``runner: pooling``; docs/pooling.md). One JSON object per prompt."""

from __future__ import annotations

import json
import sys
import time

from pagoda.cli.engine_args import add_engine_args, engine_config_from_args, read_prompts


def add_parser(sub) -> None:
    p = sub.add_parser("embed", help="embed, score or classify prompts with a pooling model (offline)",
                       description=__doc__)
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--score-against", metavar="TEXT", help="score every prompt against TEXT (a query): the score "
                   "head of a reranker, or the cosine similarity of embeddings")
    p.add_argument("--classify", action="store_true", help="class probabilities from the model's score head")
    p.add_argument("--dimensions", type=int, default=None, help="keep the first N dimensions (Matryoshka)")
    add_engine_args(p, skip=("runner",))
    p.set_defaults(func=run)


def run(args) -> int:
    from pagoda import LLM
    from pagoda.pooling import PoolingParams

    prompts = read_prompts(args)
    if not prompts:
        print("pagoda embed: give --prompt (repeatable) or --prompts-file", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    llm = LLM(config=engine_config_from_args(args, runner="pooling"))
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    if args.score_against is not None:
        scores = llm.score(args.score_against, prompts)
        rows = [{"prompt": p, "score": o.outputs.score} for p, o in zip(prompts, scores)]
    elif args.classify:
        rows = [{"prompt": p, "probs": o.outputs.probs} for p, o in zip(prompts, llm.classify(prompts))]
    else:
        outs = llm.embed(prompts, PoolingParams(dimensions=args.dimensions))
        rows = [{"prompt": p, "embedding": o.outputs.embedding} for p, o in zip(prompts, outs)]
    for row in rows:
        print(json.dumps(row))
    print(f"[{llm.engine.model_name} on {llm.engine.platform.name}/{llm.engine.dtype}: loaded in {load_s:.1f}s, "
          f"{len(prompts)} prompts in {time.perf_counter() - t1:.2f}s]", file=sys.stderr)
    return 0
