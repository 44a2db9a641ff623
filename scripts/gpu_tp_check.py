"""Tensor/expert parallelism at real layer shapes: TP=2 (and EP=2 for MoE) greedy == TP=1.

For each ``--shapes`` entry ``name:layers`` (a ``pagoda bench`` shape with fewer layers, every
width as in the real model) this saves a random checkpoint with transformers (weights widened
as in the CPU tests, so that greedy choices are not near-ties), generates greedily with
``tensor_parallel_size`` 1 and 2 (and 2 with ``enable_expert_parallel`` for MoE shapes) in
each ``--dtypes``, and reports per run how many prompts match TP=1 exactly and the mean
length of the common prefix. float32 must match exactly (exit status 1 otherwise); bfloat16
is reported (reduction order differs between 1 and 2 ranks, so long bf16 continuations may
drift apart after a near-tie).

    python scripts/gpu_tp_check.py --out out/gpu-tp                      # on a 2-GPU machine
    python scripts/gpu_tp_check.py --device cpu --dtypes float32 \\
        --set hidden_size=64 --set intermediate_size=128 ...             # a CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import yaml


def _override(fields: dict, items: list[str]) -> dict:
    for item in items:
        key, _, value = item.partition("=")
        fields[key] = yaml.safe_load(value)
    return fields


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _generate(path: Path, prompts, args, dtype: str, **parallel) -> tuple[list[list[int]], float]:
    import torch
    from pagoda import LLM, SamplingParams

    llm = LLM(model=str(path), device=args.device, dtype=dtype, max_model_len=args.prompt_len + args.max_tokens,
              max_num_seqs=len(prompts), skip_tokenizer_init=True, **parallel)
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
        seconds = time.perf_counter() - t0
        return [o.outputs[0].token_ids for o in outs], seconds
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def check_shape(name: str, layers: int, args, out_dir: Path) -> list[dict]:
    from pagoda.bench.shapes import SHAPES
    from pagoda.testing import make_tiny_checkpoint, random_prompts

    fields = dict(SHAPES[name])
    model_type = fields.pop("model_type")
    fields["num_hidden_layers"] = layers
    if "first_k_dense_replace" in fields:
        fields["first_k_dense_replace"] = min(fields["first_k_dense_replace"], layers - 1)
    fields = _override(fields, args.set)
    path = out_dir / f"ckpt-{name}-{layers}l"
    t0 = time.perf_counter()
    if not (path / "config.json").is_file():
        make_tiny_checkpoint(model_type, path, seed=0, **fields)
    print(f"[{name} x {layers} layers] checkpoint ready in {time.perf_counter() - t0:.0f} s", flush=True)
    moe = "moe_intermediate_size" in SHAPES[name]
    prompts = random_prompts(args.num_prompts, fields["vocab_size"], args.prompt_len, args.prompt_len, seed=1,
                             low=100)
    known = {"tp2": dict(tensor_parallel_size=2), "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
             "pp2": dict(pipeline_parallel_size=2), "dp2": dict(data_parallel_size=2)}
    modes = [(m, known[m]) for m in args.modes.split(",") if m in known and (moe or m != "ep2")]
    rows = []
    for dtype in args.dtypes.split(","):
        ref, ref_s = _generate(path, prompts, args, dtype)
        print(f"  {dtype:9s} tp1 generated in {ref_s:.1f} s", flush=True)
        for mode, parallel in modes:
            got, seconds = _generate(path, prompts, args, dtype, **parallel)
            prefixes = [_common_prefix(a, b) for a, b in zip(ref, got)]
            row = {"shape": name, "layers": layers, "dtype": dtype, "mode": mode,
                   "prompts_equal": sum(a == b for a, b in zip(ref, got)), "prompts": len(prompts),
                   "mean_common_prefix": sum(prefixes) / len(prefixes), "max_tokens": args.max_tokens,
                   "tp1_seconds": ref_s, "seconds": seconds}
            rows.append(row)
            print(f"  {dtype:9s} {mode} vs tp1: {row['prompts_equal']}/{row['prompts']} prompts equal, mean common "
                  f"prefix {row['mean_common_prefix']:.1f}/{args.max_tokens} tokens", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/gpu-tp", help="directory for checkpoints and equality.json")
    ap.add_argument("--shapes", default="qwen3-0.6b:4,qwen3-30b-a3b:2", help="name:layers, comma-separated")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", default="tp2,ep2", help="compared with one GPU: tp2, ep2 (MoE shapes), pp2, dp2")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field of every shape (e.g. for a small CPU run)")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for entry in args.shapes.split(","):
        name, _, layers = entry.partition(":")
        rows += check_shape(name, int(layers or 2), args, out_dir)
    (out_dir / "equality.json").write_text(json.dumps(rows, indent=1))
    failed = [r for r in rows if r["dtype"] == "float32" and r["prompts_equal"] != r["prompts"]]
    print(f"wrote {out_dir / 'equality.json'}; float32 " + ("MISMATCH: " + ", ".join(
        f"{r['shape']} {r['mode']}" for r in failed) if failed else "all equal"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
