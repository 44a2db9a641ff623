"""``pagoda bench throughput``: offline generation throughput, like vLLM's benchmark_throughput.

A model directory (``--model``) or a named random-weight shape (``--shape``, built on the
device with ``load_format: dummy``); random token-id prompts; all submitted at once. After a
short warm-up the workload runs ``--repeats`` times (fresh prompts each time, so the prefix
cache never helps); the best run is reported with every run kept in the JSON. The result
also holds the engine's time split, MoE expert load, the roofline bound and the fraction of
it reached, an optional decode-step profile and an optional HF transformers baseline.
The JSON format is documented in docs/benchmarks.md.
"""

from __future__ import annotations

import datetime
import gc
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

SCHEMA = "pagoda.bench.throughput/1"


def add_parser(sub) -> None:
    from pagoda.bench.shapes import add_shape_arg
    from pagoda.cli.engine_args import add_engine_args

    p = sub.add_parser("throughput", help="offline generation throughput (model dir or --shape)",
                       description=__doc__.split("\n\n")[0])
    add_shape_arg(p)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --output-len tokens")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of the workload (best is reported)")
    p.add_argument("--warmup-prompts", type=int, default=None, help="prompts of the warm-up run, each generating "
                   "8 tokens (default: --num-prompts, so every batch shape the run meets is compiled before the "
                   "timed runs; 0: no warm-up)")
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", metavar="FILE", help="write the result as JSON")
    p.add_argument("--profile", action="store_true", help="profile decode steps (host phases, kernels)")
    p.add_argument("--baseline", choices=["hf", "llama.cpp"], help="also run HF transformers generate (all prompts "
                   "in one batch) or llama.cpp (llama-cpp-python, .gguf models; one prompt after another) on the "
                   "same workload, in this process")
    p.add_argument("--baseline-max-seconds", type=float, default=120.0,
                   help="stop the baseline's generate after this long (default 120)")
    p.add_argument("--bandwidth-gbs", type=float, help="device bandwidth for the roofline, GB/s (default: "
                   "measured here)")
    p.add_argument("--matmul-tflops", type=float, help="matmul rate for the roofline, TFLOP/s (default: "
                   "measured here)")
    p.add_argument("--save-expert-placement", metavar="FILE", help="with enable_expert_parallel: write the "
                   "balanced expert placement computed from this run's expert load (then pass it as "
                   "--expert-placement)")
    from pagoda.bench.image_workload import add_image_args

    add_image_args(p)
    p.add_argument("--lora", type=int, default=0, metavar="N", help="N distinct random LoRA adapters (all q/k/v/o "
                   "and gate/up/down projections), one per prompt round-robin (sets enable_lora and max_loras=N)")
    p.add_argument("--lora-rank", type=int, default=16, help="rank of the --lora adapters (default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the workload's requests "
                   "(default 0: greedy; above 0 they sample, unseeded)")
    p.add_argument("--structured-outputs", choices=("json", "regex", "choice"), default=None,
                   help="constrain every request with the grammar `pagoda bench serve --structured-outputs` sends "
                   "(the model needs a tokenizer: a model directory, with --load-format dummy for random weights)")
    add_engine_args(p)
    p.set_defaults(func=run)


def _prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    low = min(100, vocab // 2)  # stay clear of the special ids most vocabularies start with
    return rng.integers(low, vocab, size=(num, length)).tolist()


def _one_run(llm, prompts, params, loras=None) -> dict:
    from pagoda.engine.step_completion import StepTimes

    engine = llm.engine
    engine.times = StepTimes()
    preempt0 = engine.scheduler.stats.num_preemptions
    lookahead = getattr(engine, "pipeline", None)
    ahead0 = lookahead.launched_ahead if lookahead is not None else 0
    engine.platform.synchronize()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=_per_prompt(loras, len(prompts)))
    engine.platform.synchronize()
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outputs)  # with image tokens (image workload)
    images = sum(len(p["multi_modal_data"]["image"]) for p in prompts if isinstance(p, dict))
    return {
        "images": images, "images_per_s": images / elapsed,
        "elapsed_seconds": elapsed, "output_tokens": out_tokens, "input_tokens": in_tokens,
        "requests_per_s": len(prompts) / elapsed, "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (out_tokens + in_tokens) / elapsed,
        "times": {k: v for k, v in asdict(engine.times).items() if k != "extra"},
        "grammar_mask": llm.get_stats().get("structured_outputs"),  # (cumulative; None unconstrained)
        "num_preemptions": engine.scheduler.stats.num_preemptions - preempt0,
        # decode steps launched before the previous step's tokens reached the host
        "steps_launched_ahead": (lookahead.launched_ahead - ahead0) if lookahead is not None else 0,
        "latency_ms": request_latencies(outputs),
    }


def _constraint(kind: str | None):
    """--structured-outputs: the grammar of ``pagoda bench serve``'s constrained requests."""
    if kind is None:
        return None
    from pagoda.bench.serve_client import BENCH_CONSTRAINTS
    from pagoda.structured_outputs import StructuredOutputsParams

    return StructuredOutputsParams(**BENCH_CONSTRAINTS[kind])


def _per_prompt(loras, n: int):
    """--lora: the adapters round-robin over ``n`` prompts; None without."""
    return [loras[i % len(loras)] for i in range(n)] if loras else None


def request_latencies(outputs) -> dict:
    """Percentiles (ms) over the requests of one run: time to first token, time per output
    token after the first, and end-to-end time (all requests arrive at the start)."""
    from pagoda.bench.serve import percentiles

    ttft, tpot, e2e = [], [], []
    for out in outputs:
        m = out.metrics
        if m is None or m.first_token_time is None or m.finished_time is None:
            continue
        ttft.append(m.first_token_time - m.arrival_time)
        e2e.append(m.finished_time - m.arrival_time)
        n = max(len(c.token_ids) for c in out.outputs)
        if n > 1:
            tpot.append((m.finished_time - m.first_token_time) / (n - 1))
    ms = lambda d: {k: (None if v is None else v * 1000.0) for k, v in d.items()}  # noqa: E731
    return {"ttft": ms(percentiles(ttft)), "tpot": ms(percentiles(tpot)), "e2e": ms(percentiles(e2e))}


def _build_config(args, tmp: str):
    from pagoda.bench.shapes import shape_engine_args
    from pagoda.cli.engine_args import engine_config_from_args

    extra = shape_engine_args(args, tmp)
    if args.max_model_len is None:
        from pagoda.bench.image_workload import image_tokens_bound

        extra["max_model_len"] = args.input_len + args.output_len + \
            args.images_per_prompt * image_tokens_bound(args.image_size)
    if args.lora:
        extra.update(enable_lora=True, max_loras=args.max_loras or args.lora,
                     max_lora_rank=max(args.max_lora_rank or 0, args.lora_rank))
    return engine_config_from_args(args, **extra)


def run(args) -> int:
    import torch

    from pagoda import LLM, SamplingParams, __version__
    from pagoda.bench.roofline import Ceilings, Workload, measure_ceilings, model_counts, workload_floor
    from pagoda.engine.gc_freeze import freeze_startup_objects, release_startup_objects
    from pagoda.selection import platform_of

    with tempfile.TemporaryDirectory(prefix="pagoda-bench-") as tmp:
        config = _build_config(args, tmp)
        t0 = time.perf_counter()
        llm = LLM(config=config)
        setup_s = time.perf_counter() - t0
        if config.data_parallel_size > 1:  # replicas in their own processes: no roofline here
            from pagoda.bench.throughput_dp import run_data_parallel

            return run_data_parallel(args, config, llm, setup_s, _prompts, _write)
        freeze_startup_objects()  # as pagoda serve does: collections do not scan the engine
        engine = llm.engine
        runner = engine.runner
        hf_config = engine.hf_config
        vocab = hf_config.vocab_size
        params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=args.ignore_eos,
                                detokenize=False, structured_outputs=_constraint(args.structured_outputs))
        make_prompts = _prompts
        if args.images_per_prompt:  # the image workload: random images before each prompt's tokens
            from pagoda.bench.image_workload import image_prompts

            def make_prompts(num, length, vocab, seed):
                return image_prompts(engine, _prompts(num, length, vocab, seed), args.images_per_prompt,
                                     args.image_size, seed)
        loras = None
        if args.lora:
            from pagoda.bench.lora_adapters import write_random_adapters
            from pagoda.lora import LoRARequest

            paths = write_random_adapters(hf_config, Path(tmp) / "loras", args.lora, args.lora_rank)
            loras = [LoRARequest(f"bench-{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        if args.warmup_prompts is None:
            args.warmup_prompts = args.num_prompts
        if args.warmup_prompts:
            # (under the run's grammar too: its compile and the mask kernel's first launch stay out of the runs)
            warm = SamplingParams(temperature=0.0, max_tokens=min(8, args.output_len), ignore_eos=True,
                                  detokenize=False, structured_outputs=params.structured_outputs)
            llm.generate(make_prompts(args.warmup_prompts, args.input_len, vocab, args.prompt_seed + 999), warm,
                         lora_request=_per_prompt(loras, args.warmup_prompts))
        runs = []
        for r in range(args.repeats):
            prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.prompt_seed + r)
            runs.append(_one_run(llm, prompts, params, loras))
        best = max(runs, key=lambda x: x["output_tok_s"])
        stats = llm.get_stats()
        experts = stats.get("expert_load")
        from pagoda.distributed.expert_placement import expert_balance

        balance = expert_balance(experts and experts["layers"], config, args.save_expert_placement)
        profile = None
        if args.profile:
            from pagoda.bench.profile import profile_decode, profile_timeline

            greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
            adapters = _per_prompt(loras, args.num_prompts)  # the workload's adapters (--lora), if any
            profile = profile_decode(llm, make_prompts(args.num_prompts, args.input_len, vocab, args.prompt_seed + 77),
                                     greedy, lora_requests=adapters)
            # the measured workload again, on fresh prompts (no prefix-cache hits), launches marked
            profile["timeline"] = profile_timeline(
                llm, make_prompts(args.num_prompts, args.input_len, vocab, args.prompt_seed + 78), params, adapters)
        device = runner.device
        if args.bandwidth_gbs and args.matmul_tflops:
            ceilings = Ceilings(args.bandwidth_gbs * 1e9, args.matmul_tflops * 1e12, False)
        else:
            ceilings = measure_ceilings(device, runner.dtype)
            if args.bandwidth_gbs:
                ceilings.bandwidth = args.bandwidth_gbs * 1e9
            if args.matmul_tflops:
                ceilings.matmul_flops = args.matmul_tflops * 1e12
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        counts = model_counts(runner.model, text_config)
        work = Workload(args.num_prompts, args.input_len, args.output_len)
        floor = workload_floor(work, counts, runner.kv_layer_bytes(), text_config, ceilings)
        result = {
            "schema": SCHEMA,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "pagoda_version": __version__, "torch_version": torch.__version__,
            "command": "pagoda " + " ".join(sys.argv[1:]),
            "device": engine.platform.describe(), "platform": engine.platform.name, "dtype": engine.dtype,
            "model": {"shape": args.shape, "path": None if args.shape else config.model,
                      "architecture": (getattr(hf_config, "architectures", None) or ["?"])[0],
                      "weight_bytes": counts["weight_bytes"], "kv_bytes_per_token": runner.kv_bytes_per_token(),
                      "kv_cache_dtype": str(runner.kv_cache_dtype()).removeprefix("torch."),
                      "attention_backends": {k: b.name for k, b in runner.backends.items()},
                      "cuda_graphs": runner.graphs is not None},
            "workload": {**asdict(work), "ignore_eos": args.ignore_eos, "repeats": args.repeats,
                         "images_per_prompt": args.images_per_prompt, "image_size": args.image_size,
                         "lora_adapters": args.lora, "lora_rank": args.lora_rank if args.lora else None,
                         "structured_outputs": args.structured_outputs, "temperature": args.temperature,
                         "warmup_prompts": args.warmup_prompts, "step_tokens": engine.scheduler.max_num_batched_tokens},
            "engine_config": config.model_dump(mode="json"),
            "setup_seconds": setup_s,
            "runs": runs,
            "best": best,
            "expert_load": None if not experts else {k: experts[k] for k in ("max_over_mean", "active_share",
                                                                               "total")},
            "expert_balance": balance,
            "roofline": floor,
            "fraction_of_bound": best["output_tok_s"] / floor["bound_output_tok_s"],
            "profile": profile,
            "baseline": None,
            "speculative": stats.get("speculative"),
        }
        print("\n".join(format_result(result)), flush=True)
        _write(result, args.json_path)
        release_startup_objects()  # frozen objects are never collected: the engine may go from here
        if args.baseline == "llama.cpp":
            result["baseline"] = _llama_cpp_baseline(engine.source, args, vocab)
            llm.shutdown()
            print(format_baseline(result))
            _write(result, args.json_path)
        elif args.baseline == "hf":
            from pagoda.bench.hf_baseline import run_hf_baseline

            dtype = runner.dtype
            model_dir = None if args.shape else str(engine.source.path)
            llm.shutdown()
            del llm, engine, runner
            gc.collect()  # the engine's KV cache and graphs go before the baseline allocates
            platform_of(device).empty_cache()
            try:
                result["baseline"] = run_hf_baseline(
                    hf_config, model_dir, _prompts(args.num_prompts, args.input_len, vocab, args.prompt_seed),
                    args.output_len, device, dtype, args.baseline_max_seconds)
            except Exception as exc:  # the pagoda numbers stand; say why the baseline has none
                result["baseline"] = {"engine": "transformers", "error": f"{type(exc).__name__}: {exc}"[:500]}
            print(format_baseline(result))
            _write(result, args.json_path)
        else:
            llm.shutdown()  # explicit, in order: a tensor-parallel run's workers go before the process ends
    return 0


def _llama_cpp_baseline(source, args, vocab: int) -> dict:
    import torch

    from pagoda.bench.baselines import latency_summary, run_llama_cpp

    try:
        if source.kind != "gguf":
            raise ValueError("the llama.cpp baseline runs .gguf models only")
        rec = run_llama_cpp(source.path, _prompts(args.num_prompts, args.input_len, vocab, args.prompt_seed),
                            args.output_len, torch.get_num_threads(), args.baseline_max_seconds,
                            n_ctx=args.input_len + args.output_len + 8)
    except Exception as exc:  # the pagoda numbers stand; say why the baseline has none
        return {"engine": "llama.cpp", "error": f"{type(exc).__name__}: {exc}"[:500]}
    rec["latency_ms"] = latency_summary(rec.pop("token_times"))
    return rec


def _write(result: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")


def format_baseline(res: dict) -> str:
    b = res["baseline"]
    name = "llama.cpp" if b.get("engine") == "llama.cpp" else "HF transformers"
    if "error" in b:
        return f"  {name:<16} failed: {b['error'].splitlines()[0][:200]}"
    capped = f" (stopped at {b['max_seconds']:.0f} s)" if b["capped"] else ""
    return (f"  {name:<16} {b['output_tok_s']:,.1f} output tok/s{capped}; pagoda is "
            f"{res['best']['output_tok_s'] / b['output_tok_s']:.2f}x")


def _kv_cache_note(res: dict) -> str:
    """', KV cache <dtype>' where the cache is not kept in the model dtype (e.g. fp8)."""
    kv = res["model"].get("kv_cache_dtype")
    return f", KV cache {kv}" if kv and kv != res["dtype"] else ""


def format_result(res: dict) -> list[str]:
    w, best, floor = res["workload"], res["best"], res["roofline"]
    name = res["model"]["shape"] or res["model"]["path"]
    t = best["times"]
    c = floor["ceilings"]
    spread = ", ".join(f"{r['output_tok_s']:,.0f}" for r in res["runs"])
    lines = [
        f"pagoda bench throughput: {name} ({res['model']['architecture']}), {w['num_prompts']} prompts x "
        f"{w['input_len']} in x {w['output_len']} out, {res['dtype']} on {res['device']}"
        f"{_kv_cache_note(res)}" + (f", {w['lora_adapters']} LoRA adapters of rank {w['lora_rank']}"
                                    if w.get("lora_adapters") else ""),
        f"  requests/s       {best['requests_per_s']:,.2f}",
        f"  output tok/s     {best['output_tok_s']:,.0f}   (runs: {spread})",
        f"  total tok/s      {best['total_tok_s']:,.0f}",
        *([f"  images/s         {best['images_per_s']:,.2f}   ({w['images_per_prompt']} of {w['image_size']} "
           f"per prompt)"] if w.get("images_per_prompt") else []),
        f"  time split       {best['elapsed_seconds']:.3f} s: prefill {t['prefill']:.3f} s, "
        f"decode {t['decode']:.3f} s, scheduling {t['schedule']:.3f} s, postprocess {t['postprocess']:.3f} s "
        f"over {t['steps']} steps ({best.get('steps_launched_ahead', 0)} launched ahead)",
        f"  roofline         {floor['bound_output_tok_s']:,.0f} output tok/s ({floor['bound_by']}-bound: "
        f"{floor['decode_bytes'] / 1e9:,.0f} GB at {c['bandwidth'] / 1e12:.2f} TB/s = "
        f"{floor['bytes_seconds']:.3f} s; {floor['flops'] / 1e12:,.2f} TFLOP at {c['matmul_flops'] / 1e12:.1f} "
        f"TFLOP/s = {floor['flops_seconds']:.3f} s)",
        f"  reached          {100 * res['fraction_of_bound']:.1f}% of the bound",
        f"  step budget      {w.get('step_tokens')} tokens (max_num_batched_tokens)",
    ]
    if res["expert_load"]:
        e = res["expert_load"]
        lines.append(f"  expert load      max/mean {e['max_over_mean']:.2f}, "
                     f"experts used {100 * e['active_share']:.0f}%")
    if res.get("expert_balance"):
        b = res["expert_balance"]
        lines.append(f"  expert balance   busiest rank / mean over {b['ranks']} expert-parallel ranks: "
                     f"{b['before']:.3f} ({b['current']}) -> {b['after']:.3f} balanced "
                     f"({b['slots_per_rank']} slots per rank)" + (f", saved to {b['saved_to']}" if b.get("saved_to")
                                                                  else ""))
    if best["num_preemptions"]:
        lines.append(f"  preemptions      {best['num_preemptions']}")
    from pagoda.speculative.stats import speculative_lines

    lines += speculative_lines(res.get("speculative"))
    if res["profile"]:
        from pagoda.bench.profile import format_profile

        lines += ["  " + line for line in format_profile(res["profile"])]
    if res["baseline"]:
        lines.append(format_baseline(res))
    return lines
