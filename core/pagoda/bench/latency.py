"""``pagoda bench latency``: the latency of one batch, as ``vllm bench latency``.

A batch of ``--batch-size`` random prompts of ``--input-len`` tokens generates ``--output-len`` tokens
each (EOS ignored), ``--num-iters-warmup`` times untimed, then ``--num-iters`` times timed. Reported:
the batch's end-to-end time per iteration (mean and percentiles, as vLLM), and over every request of
the timed iterations the time to first token, the inter-token latency (time between consecutive
tokens of a request) and the request's end-to-end time, p50/p90/p99 in ms. Tokens are timed as the
engine hands them out (``LLMEngine.step``). ``--shape`` runs a random-weight model of a named shape
(as ``pagoda bench throughput --shape``). The floor: one decode step reads every weight once and the
batch's KV cache at the mean decode context; those bytes over the measured copy bandwidth
(``--bandwidth-gbs`` to give it) are the least inter-token latency, reported with the fraction
floor / p50 ITL. ``--baseline llama.cpp`` (llama-cpp-python, .gguf models)
and ``--baseline hf`` run the same prompts in the same process, one request at a time.
"""

from __future__ import annotations

import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

from pagoda.speculative.stats import speculative_lines

SCHEMA = "pagoda.bench.latency/1"


def add_parser(sub) -> None:
    from pagoda.bench.shapes import add_shape_arg
    from pagoda.cli.engine_args import add_engine_args

    p = sub.add_parser("latency", help="latency of one batch: end-to-end, time to first token, inter-token",
                       description=__doc__.split("\n\n")[0])
    add_shape_arg(p)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--prompt-period", type=int, default=None, metavar="N",
                   help="repetitive prompts: N random tokens repeated up to --input-len (a workload where n-gram "
                   "speculative decoding finds its drafts; default: random prompts)")
    p.add_argument("--baseline", action="append", choices=["llama.cpp", "hf"], default=None,
                   help="also run llama.cpp (llama-cpp-python; .gguf models) or HF transformers on the same "
                   "prompts (repeat for both)")
    p.add_argument("--baseline-max-seconds", type=float, default=300.0, help="stop a baseline after this long")
    p.add_argument("--bandwidth-gbs", type=float, help="device bandwidth for the floor, GB/s (default: measured "
                   "here)")
    p.add_argument("--json", dest="json_path", metavar="FILE", help="write the result as JSON")
    add_engine_args(p)
    p.set_defaults(func=run)


def timed_batch(engine, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[float]]]:
    """Run ``prompts`` through ``engine`` step by step: (batch seconds, per request the seconds from the
    start to each of its tokens)."""
    from pagoda.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    ids = [engine.add_request(None, p, params) for p in prompts]
    seen = {i: 0 for i in ids}
    times: dict[str, list[float]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter() - t0
            n = len(out.outputs[0].token_ids)
            times[out.request_id] += [now] * (n - seen[out.request_id])
            seen[out.request_id] = n
    return time.perf_counter() - t0, [times[i] for i in ids]


def run(args) -> int:
    with tempfile.TemporaryDirectory(prefix="pagoda-bench-latency-") as tmp:  # --shape's config.json
        return _run(args, tmp)


def _run(args, tmp: str) -> int:
    import torch

    from pagoda import LLM, __version__
    from pagoda.bench.baselines import latency_summary
    from pagoda.bench.serve import percentiles
    from pagoda.bench.shapes import shape_engine_args
    from pagoda.bench.throughput import _prompts as random_prompts
    from pagoda.cli.engine_args import engine_config_from_args
    from pagoda.speculative.stats import repeated_prompts

    def _prompts(num, length, vocab, seed):
        prompts = random_prompts(num, length, vocab, seed)
        return prompts if args.prompt_period is None else repeated_prompts(prompts, args.prompt_period)

    extra = shape_engine_args(args, tmp)
    if args.max_model_len is None:
        extra["max_model_len"] = args.input_len + args.output_len
    config = engine_config_from_args(args, **extra)
    t0 = time.perf_counter()
    llm = LLM(config=config)
    setup_s = time.perf_counter() - t0
    engine = llm.engine
    vocab = engine.hf_config.vocab_size
    for i in range(args.num_iters_warmup):
        timed_batch(engine, _prompts(args.batch_size, args.input_len, vocab, args.prompt_seed + 1000 + i),
                    args.output_len)
    batch_seconds, token_times = [], []
    for i in range(args.num_iters):  # fresh prompts each time: the prefix cache never helps
        seconds, times = timed_batch(engine, _prompts(args.batch_size, args.input_len, vocab, args.prompt_seed + i),
                                     args.output_len)
        batch_seconds.append(seconds)
        token_times += times
    requests_ms = latency_summary(token_times)
    floor = decode_floor(engine, args)
    p50 = requests_ms["itl"]["p50"]
    result = {
        "schema": SCHEMA, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "pagoda_version": __version__, "torch_version": torch.__version__,
        "command": "pagoda " + " ".join(sys.argv[1:]), "device": engine.platform.describe(),
        "platform": engine.platform.name, "dtype": engine.dtype, "model": engine.model_name, "shape": args.shape,
        "workload": {"batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
                     "num_iters": args.num_iters, "num_iters_warmup": args.num_iters_warmup,
                     "step_tokens": engine.scheduler.max_num_batched_tokens},
        "engine_config": config.model_dump(mode="json"), "setup_seconds": setup_s,
        "batch_latency_s": {"runs": batch_seconds, **percentiles(batch_seconds)},
        "requests_ms": requests_ms,
        "floor": floor,
        "fraction_of_floor": floor["itl_ms"] / p50 if floor and p50 else None,
        "output_tok_s": args.batch_size * args.output_len * len(batch_seconds) / sum(batch_seconds),
        "speculative": llm.get_stats().get("speculative"),
        "baselines": {},
    }
    print("\n".join(format_latency(result)), flush=True)
    source = engine.source
    dtype = engine.runner.dtype if hasattr(engine.runner, "dtype") else torch.float32
    device = engine.runner.device if hasattr(engine.runner, "device") else torch.device("cpu")
    threads = torch.get_num_threads()
    llm.shutdown()
    del llm, engine
    prompts = _prompts(args.batch_size, args.input_len, vocab, args.prompt_seed)
    for name in args.baseline or []:
        result["baselines"][name] = _baseline(name, source, config, prompts, args, threads, device, dtype)
        print(format_baseline(name, result), flush=True)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json_path}")
    return 0


def decode_floor(engine, args) -> dict | None:
    """The least inter-token latency of this batch (``roofline.decode_step_floor``); None where the engine's
    model lives in other processes (tensor or pipeline parallel)."""
    from pagoda.bench.roofline import Workload, decode_step_floor, measure_bandwidth, model_counts

    runner = engine.runner
    if not hasattr(runner, "kv_layer_bytes"):
        return None
    hf_config = engine.hf_config
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    bandwidth = args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else measure_bandwidth(runner.device)
    return decode_step_floor(Workload(args.batch_size, args.input_len, args.output_len),
                             model_counts(runner.model, text_config), runner.kv_layer_bytes(), text_config,
                             bandwidth, measured=not args.bandwidth_gbs)


def _baseline(name, source, config, prompts, args, threads, device, dtype) -> dict:
    from pagoda.bench.baselines import latency_summary, run_hf_streamed, run_llama_cpp

    try:
        if name == "llama.cpp":
            if source.kind != "gguf":
                raise ValueError("the llama.cpp baseline runs .gguf models only")
            rec = run_llama_cpp(source.path, prompts, args.output_len, threads, args.baseline_max_seconds,
                                n_ctx=args.input_len + args.output_len + 8)
        else:
            model = str(source.path) if config.load_format != "dummy" else None
            from pagoda.loader.model_loader import load_config

            rec = run_hf_streamed(model, load_config(source), prompts, args.output_len, device, dtype,
                                  args.baseline_max_seconds)
    except Exception as exc:  # pagoda's numbers stand; say why the baseline has none
        return {"engine": name, "error": f"{type(exc).__name__}: {exc}"[:500]}
    rec["requests_ms"] = latency_summary(rec.pop("token_times"))
    return rec


def _ms(d: dict) -> str:
    return "p50 {:.1f}  p90 {:.1f}  p99 {:.1f}".format(*(d[k] or 0.0 for k in ("p50", "p90", "p99")))


def format_latency(res: dict) -> list[str]:
    w, b, r = res["workload"], res["batch_latency_s"], res["requests_ms"]
    return [
        f"pagoda bench latency: {res['model']}, batch {w['batch_size']} x {w['input_len']} in x {w['output_len']} "
        f"out, {res['dtype']} on {res['device']}",
        f"  batch latency    mean {b['mean']:.3f} s  p50 {b['p50']:.3f}  p90 {b['p90']:.3f}  p99 {b['p99']:.3f} "
        f"({len(b['runs'])} iterations)",
        f"  ttft ms          {_ms(r['ttft'])}",
        f"  itl ms           {_ms(r['itl'])}",
        f"  e2e ms           {_ms(r['e2e'])}",
        f"  output tok/s     {res['output_tok_s']:,.1f}",
    ] + _floor_lines(res) + speculative_lines(res.get("speculative"))


def _floor_lines(res: dict) -> list[str]:
    f = res.get("floor")
    if not f:
        return []
    frac = res.get("fraction_of_floor")
    return [f"  floor itl ms     {f['itl_ms']:.3f}  (weights {f['weight_bytes'] / 1e6:,.1f} MB + KV "
            f"{f['kv_bytes'] / 1e6:,.1f} MB per step at {f['bandwidth'] / 1e9:,.1f} GB/s, "
            f"{'measured' if f['bandwidth_measured'] else 'given'})",
            "  floor / p50 itl  " + ("n/a (p50 itl is 0)" if frac is None else f"{frac:.3f}")]


def format_baseline(name: str, res: dict) -> str:
    rec = res["baselines"][name]
    if "error" in rec:
        return f"  {name:<16} failed: {rec['error'].splitlines()[0][:200]}"
    r = rec["requests_ms"]
    ours = res["requests_ms"]
    ratio = (r["itl"]["p50"] / ours["itl"]["p50"]) if r["itl"]["p50"] and ours["itl"]["p50"] else float("nan")
    return (f"  {name:<16} one request at a time: ttft {_ms(r['ttft'])}; itl {_ms(r['itl'])}; "
            f"{rec['output_tok_s']:,.1f} output tok/s; pagoda's p50 decode speed is {ratio:.2f}x this")
