"""pagoda against llama.cpp (llama-cpp-python) and HF transformers on the CPU, runs interleaved, medians.

    python scripts/cpu_compare.py decode --threads 1 --reps 5      # single-stream decode tok/s, TTFT (256 tokens)
    python scripts/cpu_compare.py long --tokens 7000               # prefill time of one long prompt
    python scripts/cpu_compare.py concurrent --prompts 16          # output tok/s of 16 prompts at once
    python scripts/cpu_compare.py memory                           # peak resident memory, separate processes
    python scripts/cpu_compare.py startup --reps 5                 # start to first token of `pagoda generate`

The default model (SmolLM2-135M-Instruct Q4_1) unless --model names a .gguf file. Other programs share
the machine: every comparison alternates the engines and reports medians and ratios (docs/benchmarks.md).
llama-cpp-python is not a pagoda dependency: pip install llama-cpp-python (it builds from source).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def model_path(args) -> str:
    if args.model:
        return args.model
    from pagoda.loader.source import default_model_path

    return str(default_model_path())


def prompt_ids(n: int, vocab: int = 49152, seed: int = 0) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(100, vocab, n).tolist()


def decode(args) -> dict:
    import torch
    from llama_cpp import Llama
    from pagoda import LLM

    torch.set_num_threads(args.threads)
    path = model_path(args)
    ll = Llama(model_path=path, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=1024, verbose=False)
    llm = LLM(model=path, device="cpu", max_model_len=1024)
    from pathlib import Path

    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name, dtype=torch.float32)
    short = prompt_ids(8, seed=1)

    def llama(prompt, n):
        ll.reset()
        t0, times = time.perf_counter(), []
        for _ in ll.generate(prompt, temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter() - t0)
            if len(times) >= n:
                break
        return times

    def pagoda(prompt, n):
        from pagoda.bench.latency import timed_batch

        return timed_batch(llm.engine, [prompt], n)[1][0]

    def transformers(prompt, n):
        class Clock:
            def __init__(self):
                self.t0, self.times, self.first = time.perf_counter(), [], True

            def put(self, value):
                if self.first:
                    self.first = False
                    return
                self.times.append(time.perf_counter() - self.t0)

            def end(self):
                pass

        clock = Clock()
        with torch.inference_mode():
            hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=clock,
                        pad_token_id=0)
        return clock.times

    engines = {"pagoda": pagoda, "llama.cpp": llama, "transformers": transformers}
    for f in engines.values():
        f(short, 4)
    rows = {k: {"decode_tok_s": [], "ttft_256_ms": [], "cpu_s_per_run": [], "ttft_256_cpu_ms": []} for k in engines}
    for rep in range(args.reps):
        long = prompt_ids(256, seed=100 + rep)  # a new prompt each time: no engine's prefix cache helps
        for name, f in engines.items():
            c0 = time.process_time()  # CPU time: steadier than wall time on a shared machine
            t = f(short, args.tokens)
            rows[name]["cpu_s_per_run"].append(time.process_time() - c0)
            rows[name]["decode_tok_s"].append((len(t) - 1) / (t[-1] - t[0]))
            c0 = time.process_time()
            rows[name]["ttft_256_ms"].append(1000 * f(long, 1)[0])
            rows[name]["ttft_256_cpu_ms"].append(1000 * (time.process_time() - c0))
    return summarize(rows, "pagoda", f"decode, {args.threads} thread(s)")


def long_prompt(args) -> dict:
    import torch
    from pagoda import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = model_path(args)
    ids = prompt_ids(args.tokens, seed=3)
    llm = LLM(model=path, device="cpu", max_model_len=args.tokens + 16)
    hf = AutoModelForCausalLM.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name, dtype=torch.float32,
                                              attn_implementation="sdpa")
    rows = {"pagoda": {"prefill_s": [], "cpu_s": []}, "transformers": {"prefill_s": [], "cpu_s": []}}
    for _ in range(args.reps):
        t0, c0 = time.perf_counter(), time.process_time()
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
        rows["pagoda"]["prefill_s"].append(time.perf_counter() - t0)
        rows["pagoda"]["cpu_s"].append(time.process_time() - c0)
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            hf(torch.tensor([ids]), logits_to_keep=1)
        rows["transformers"]["prefill_s"].append(time.perf_counter() - t0)
        rows["transformers"]["cpu_s"].append(time.process_time() - c0)
    return summarize(rows, "pagoda", f"{args.tokens}-token prompt, {args.threads} thread(s)")


def concurrent(args) -> dict:
    import torch
    from pagoda import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    from pathlib import Path

    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM

    path = model_path(args)
    prompts = [prompt_ids(args.input_len, seed=10 + i) for i in range(args.prompts)]
    llm = LLM(model=path, device="cpu", max_model_len=args.input_len + args.output_len + 8)
    hf = AutoModelForCausalLM.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name, dtype=torch.float32)
    ll = Llama(model_path=path, n_threads=args.threads, n_threads_batch=args.threads,
               n_ctx=args.input_len + args.output_len + 8, verbose=False)
    rows = {k: {"output_tok_s": [], "output_tok_per_cpu_s": []} for k in ("pagoda", "transformers", "llama.cpp")}
    total = args.prompts * args.output_len

    def record(name, t0, c0):
        rows[name]["output_tok_s"].append(total / (time.perf_counter() - t0))
        rows[name]["output_tok_per_cpu_s"].append(total / (time.process_time() - c0))

    for _ in range(args.reps):
        t0, c0 = time.perf_counter(), time.process_time()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True))
        record("pagoda", t0, c0)
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            mask = torch.ones(len(prompts), args.input_len, dtype=torch.long)
            hf.generate(torch.tensor(prompts), attention_mask=mask, max_new_tokens=args.output_len,
                        min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
        record("transformers", t0, c0)
        t0, c0 = time.perf_counter(), time.process_time()
        for p in prompts:  # llama-cpp-python's API: one sequence at a time
            ll.reset()
            for i, _ in enumerate(ll.generate(p, temp=0.0, top_k=1, reset=True)):
                if i + 1 >= args.output_len:
                    break
        record("llama.cpp", t0, c0)
    return summarize(rows, "pagoda", f"{args.prompts} prompts x {args.input_len} in x {args.output_len} out, "
                     f"{args.threads} thread(s)")


MEMORY_CHILD = {
    "pagoda": ("import resource, sys; from pagoda import LLM, SamplingParams; llm = LLM(model=sys.argv[1], "
               "device='cpu', max_model_len=512); llm.generate('The capital of France is', SamplingParams("
               "temperature=0, max_tokens=32)); print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"),
    "llama.cpp": ("import resource, sys; from llama_cpp import Llama; ll = Llama(model_path=sys.argv[1], n_ctx=512, "
                  "n_threads=1, verbose=False); ll('The capital of France is', max_tokens=32, temperature=0); "
                  "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"),
}


def memory(args) -> dict:
    path = model_path(args)
    rows = {k: {"peak_rss_mib": []} for k in MEMORY_CHILD}
    for _ in range(args.reps):
        for name, code in MEMORY_CHILD.items():
            out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, check=True)
            rows[name]["peak_rss_mib"].append(int(out.stdout.split()[-1]) / 1024)
    return summarize(rows, "pagoda", "peak resident memory (generate 32 tokens, context 512)")


def startup(args) -> dict:
    path = model_path(args)
    rows = {k: {"seconds": [], "cpu_seconds": []} for k in ("pagoda generate", "import torch", "llama.cpp")}
    commands = {
        "pagoda generate": [sys.executable, "-m", "pagoda.cli.main", "generate", "--model", path, "--prompt",
                            "The capital of France is", "--max-tokens", "1"],
        "import torch": [sys.executable, "-c", "import torch"],
        "llama.cpp": [sys.executable, "-c", "import sys; from llama_cpp import Llama; Llama(model_path=sys.argv[1], "
                      "n_ctx=512, verbose=False)('The capital of France is', max_tokens=1)", path],
    }
    for _ in range(args.reps):
        for name, cmd in commands.items():
            t0, before = time.perf_counter(), os.times()
            subprocess.run(cmd, capture_output=True, check=True)
            after = os.times()
            rows[name]["seconds"].append(time.perf_counter() - t0)
            rows[name]["cpu_seconds"].append(after.children_user + after.children_system - before.children_user
                                             - before.children_system)
    return summarize(rows, "pagoda generate", "start to first token (separate processes)")


def summarize(rows: dict, ours: str, title: str) -> dict:
    medians = {name: {k: statistics.median(v) for k, v in vals.items()} for name, vals in rows.items()}
    ratios = {name: {k: medians[ours][k] / v for k, v in vals.items() if v}
              for name, vals in medians.items() if name != ours}
    out = {"title": title, "runs": rows, "median": medians, f"{ours} / other": ratios}
    print(json.dumps(out, indent=1), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["decode", "long", "concurrent", "memory", "startup"])
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="decode: tokens per run; long: prompt tokens")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # every engine (and pagoda's CPU platform) takes it
    res = {"decode": decode, "long": long_prompt, "concurrent": concurrent, "memory": memory,
           "startup": startup}[args.what](args)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
