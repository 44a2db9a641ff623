"""``pagoda bench throughput`` over ``data_parallel_size`` replicas: the same workload and
result keys as one engine where they apply (no roofline: each replica's runner lives in its
own process), plus each replica's share."""

from __future__ import annotations

import datetime
import sys
import time


def run_data_parallel(args, config, llm, setup_s: float, prompts_for, write) -> int:
    from pagoda import SamplingParams, __version__
    from pagoda.bench.throughput import request_latencies

    engine = llm.engine
    vocab = engine.hf_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=args.ignore_eos,
                            detokenize=False)
    warmup = args.num_prompts if args.warmup_prompts is None else args.warmup_prompts
    if warmup:
        llm.generate(prompts_for(warmup, args.input_len, vocab, args.prompt_seed + 999),
                     SamplingParams(temperature=0.0, max_tokens=min(8, args.output_len), ignore_eos=True,
                                    detokenize=False))
    runs = []
    for r in range(args.repeats):
        prompts = prompts_for(args.num_prompts, args.input_len, vocab, args.prompt_seed + r)
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        out_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        in_tokens = sum(len(p) for p in prompts)
        runs.append({"elapsed_seconds": elapsed, "output_tokens": out_tokens, "input_tokens": in_tokens,
                     "requests_per_s": len(prompts) / elapsed, "output_tok_s": out_tokens / elapsed,
                     "total_tok_s": (out_tokens + in_tokens) / elapsed, "latency_ms": request_latencies(outputs)})
    best = max(runs, key=lambda x: x["output_tok_s"])
    replicas = [{k: s.get(k) for k in ("replica", "generated_tokens", "prefill_tokens_computed", "num_preemptions")}
                for s in llm.get_stats()["data_parallel"]]
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "pagoda_version": __version__, "command": "pagoda " + " ".join(sys.argv[1:]),
        "platform": engine.platform.name, "dtype": engine.dtype, "model": {"shape": args.shape},
        "engine_config": config.model_dump(mode="json"), "setup_seconds": setup_s,
        "data_parallel_size": config.data_parallel_size, "runs": runs, "best": best, "replicas": replicas,
    }
    print(f"throughput  {best['output_tok_s']:.1f} output tok/s  {best['total_tok_s']:.1f} total tok/s  "
          f"({args.num_prompts} prompts x {args.input_len} in x {args.output_len} out, "
          f"{config.data_parallel_size} data-parallel replicas, {best['elapsed_seconds']:.2f} s)")
    for rep in replicas:
        print(f"  replica {rep['replica']}: {rep['generated_tokens']} generated tokens, "
              f"{rep['prefill_tokens_computed']} prefill tokens, {rep['num_preemptions']} preemptions")
    write(result, args.json_path)
    llm.shutdown()
    return 0
