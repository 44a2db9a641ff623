"""``pagoda bench embed``: offline embedding throughput of the pooling runner (``runner: pooling``),
with HF transformers on the same weights and prompts in the same call.

A model directory (``--model``) or a named shape (``--shape``): with ``--baseline hf`` a shape gets
transformers' random weights, saved once to a temporary directory that pagoda then loads, so both
engines compute the same model and their embeddings are compared (cosine) besides being timed.
Without a baseline a shape is built with random weights on the device (``load_format: dummy``).
Random token-id prompts of ``--input-len`` tokens; last-token pooling, normalized. The JSON
format is documented in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

SCHEMA = "pagoda.bench.embed/1"


def add_parser(sub) -> None:
    from pagoda.bench.shapes import SHAPES
    from pagoda.cli.engine_args import add_engine_args

    p = sub.add_parser("embed", help="offline embedding throughput (runner: pooling), optionally against HF",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), help="random-weight model of a named shape (instead of --model)")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2, help="timed runs (best is reported)")
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--baseline", choices=["hf"], help="also embed with HF transformers (the decoder's last hidden "
                   "state, last token, normalized) in batches of --hf-batch-size, on the same weights")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--baseline-max-seconds", type=float, default=90.0, help="stop the baseline after this long")
    p.add_argument("--check-prompts", type=int, default=8, help="prompts whose embeddings are compared (cosine)")
    p.add_argument("--json", dest="json_path", metavar="FILE", help="write the result as JSON")
    add_engine_args(p)
    p.set_defaults(func=run)


def _prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(min(100, vocab // 2), vocab, size=(num, length)).tolist()


def hf_embed(model, prompts: list[list[int]], batch_size: int, device, max_seconds: float) -> tuple:
    """(embeddings [n, H] float32 on the CPU, seconds, prompts done): the decoder's last hidden state
    (after the final norm) of each prompt's last token, normalized; equal-length prompts, no padding."""
    import torch

    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    found = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            ids = torch.tensor(prompts[i:i + batch_size], device=device)
            hidden = base(input_ids=ids).last_hidden_state[:, -1]
            found.append(torch.nn.functional.normalize(hidden.float(), dim=-1).cpu())
            if time.perf_counter() - t0 > max_seconds:
                break
    return torch.cat(found), time.perf_counter() - t0, sum(len(f) for f in found)


def _run_baseline(args, hf_config, model_dir: str | None, tmp: str, dtype, device) -> tuple[dict, str, object]:
    """Run HF first (before pagoda takes the device's memory); returns (result, model dir, reference embeddings)."""

    from pagoda.bench.baselines import load_hf_model
    from pagoda.selection import platform_of

    model = load_hf_model(model_dir, hf_config, dtype, device).eval()
    if model_dir is None:  # a shape: transformers' random weights, saved for pagoda to load
        model_dir = str(Path(tmp) / "weights")
        model.save_pretrained(model_dir, safe_serialization=True)
    vocab = hf_config.vocab_size
    hf_embed(model, _prompts(args.hf_batch_size, args.input_len, vocab, 999), args.hf_batch_size, device, 60)  # warm
    platform_of(device).synchronize()
    prompts = _prompts(args.num_prompts, args.input_len, vocab, args.prompt_seed)
    vectors, elapsed, done = hf_embed(model, prompts, args.hf_batch_size, device, args.baseline_max_seconds)
    platform_of(device).synchronize()
    result = {"engine": "transformers", "batch_size": args.hf_batch_size, "prompts": done,
              "elapsed_seconds": elapsed, "embeddings_per_s": done / elapsed,
              "tokens_per_s": done * args.input_len / elapsed, "capped": done < len(prompts)}
    reference = vectors[: args.check_prompts]
    del model
    platform_of(device).empty_cache()
    return result, model_dir, reference


def run(args) -> int:
    import torch

    from pagoda import LLM, __version__
    from pagoda.bench.shapes import shape_config, write_shape
    from pagoda.cli.engine_args import engine_config_from_args
    from pagoda.engine.model_runner import TORCH_DTYPES
    from pagoda.errors import ConfigError

    if bool(args.shape) == bool(args.model):
        raise ConfigError("give either --model or --shape")
    with tempfile.TemporaryDirectory(prefix="pagoda-bench-embed-") as tmp:
        extra = {"runner": "pooling", "max_model_len": args.max_model_len or args.input_len}
        baseline, reference = None, None
        if args.baseline == "hf":
            from pagoda.loader.model_loader import load_config
            from pagoda.loader.source import resolve_source
            from pagoda.selection import select_platform

            config = engine_config_from_args(args, **extra, model=args.model or "unused")
            device_name, dtype = config.resolved_device_and_dtype()
            platform = select_platform(device_name)
            dtype = platform.default_dtype if dtype == "auto" else dtype
            device = platform.device()
            hf_config = shape_config(args.shape) if args.shape else load_config(resolve_source(args.model))
            baseline, model_dir, reference = _run_baseline(args, hf_config, args.model, tmp, TORCH_DTYPES[dtype],
                                                           device)
            extra["model"] = model_dir
            if args.shape:
                extra["skip_tokenizer_init"] = True
        elif args.shape:
            extra.update(model=str(write_shape(args.shape, Path(tmp) / args.shape)), load_format="dummy",
                         skip_tokenizer_init=True)
        config = engine_config_from_args(args, **extra)
        t0 = time.perf_counter()
        llm = LLM(config=config)
        setup_s = time.perf_counter() - t0
        engine = llm.engine
        vocab = engine.hf_config.vocab_size
        llm.embed(_prompts(min(args.num_prompts, 64), args.input_len, vocab, 999))  # warm-up
        runs, first = [], None
        for r in range(args.repeats):
            prompts = _prompts(args.num_prompts, args.input_len, vocab, args.prompt_seed + r)
            engine.platform.synchronize()
            t1 = time.perf_counter()
            outputs = llm.embed(prompts)
            engine.platform.synchronize()
            elapsed = time.perf_counter() - t1
            first = first or outputs
            runs.append({"elapsed_seconds": elapsed, "embeddings_per_s": len(prompts) / elapsed,
                         "tokens_per_s": len(prompts) * args.input_len / elapsed})
        best = max(runs, key=lambda x: x["embeddings_per_s"])
        result = {"schema": SCHEMA, "pagoda_version": __version__, "model": args.shape or args.model,
                  "device": engine.platform.name, "dtype": str(engine.runner.dtype).replace("torch.", ""),
                  "num_prompts": args.num_prompts, "input_len": args.input_len, "setup_seconds": setup_s,
                  "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens, "pagoda": best, "runs": runs,
                  "baseline": baseline}
        if reference is not None:
            mine = torch.tensor([o.outputs.embedding for o in first[: len(reference)]])
            cos = torch.nn.functional.cosine_similarity(mine, reference, dim=-1)
            result["check"] = {"prompts": len(reference), "min_cosine": float(cos.min())}
            if baseline:
                result["speedup_vs_hf"] = best["embeddings_per_s"] / baseline["embeddings_per_s"]
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    _print(result)
    return 0


def _print(result: dict) -> None:
    p = result["pagoda"]
    lines = [f"embed {result['model']} on {result['device']} ({result['dtype']}): {result['num_prompts']} prompts x "
             f"{result['input_len']} tokens", f"  pagoda: {p['embeddings_per_s']:.1f} embeddings/s, "
             f"{p['tokens_per_s']:.0f} tok/s"]
    base = result.get("baseline")
    if base:
        lines.append(f"  transformers (batch {base['batch_size']}): {base['embeddings_per_s']:.1f} embeddings/s, "
                     f"{base['tokens_per_s']:.0f} tok/s{' (capped)' if base['capped'] else ''}; "
                     f"speedup {result['speedup_vs_hf']:.2f}x")
    if "check" in result:
        lines.append(f"  check: min cosine {result['check']['min_cosine']:.6f} over {result['check']['prompts']} "
                     f"prompts")
    print("\n".join(lines), file=sys.stdout)
