"""Baselines that ``pagoda bench throughput`` and ``pagoda bench latency`` run beside pagoda, in the same
process on the same prompts: llama.cpp (llama-cpp-python, for .gguf models) and HF transformers.

Both return the same record: ``engine``, ``load_seconds``, ``elapsed_seconds``, ``output_tokens``,
``output_tok_s`` and, per request, ``token_times`` (seconds from the request's start to each output
token, where the engine reports them). llama-cpp-python's high-level API decodes one sequence at a
time, so a batch of prompts runs one after another (that is what a llama.cpp user without a server
gets); ``threads`` is given to both of its thread pools.
"""

from __future__ import annotations

import time
from pathlib import Path

LLAMA_CPP_HINT = ("the llama.cpp baseline needs llama-cpp-python (pip install llama-cpp-python; it builds "
                  "llama.cpp from source)")


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def run_llama_cpp(model_path: str | Path, prompts: list[list[int]], output_len: int, threads: int,
                  max_seconds: float, n_ctx: int) -> dict:
    """Greedy generation of ``output_len`` tokens (EOS ignored) from each token-id prompt, in turn."""
    if not llama_cpp_available():
        from pagoda.errors import ConfigError

        raise ConfigError(LLAMA_CPP_HINT)
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=str(model_path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                n_batch=min(n_ctx, 2048), verbose=False, logits_all=False)
    load_s = time.perf_counter() - t0

    def one(prompt: list[int], limit: int) -> list[float]:
        llm.reset()
        start = time.perf_counter()
        times = []
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter() - start)
            if len(times) >= limit:
                break
        return times

    one(prompts[0][:8], 2)  # warm-up
    token_times, t1 = [], time.perf_counter()
    for prompt in prompts:
        token_times.append(one(prompt, output_len))
        if time.perf_counter() - t1 > max_seconds:
            break
    elapsed = time.perf_counter() - t1
    generated = sum(len(t) for t in token_times)
    if hasattr(llm, "close"):  # llama-cpp-python >= 0.3 frees the model's memory here
        llm.close()
    return {"engine": "llama.cpp", "threads": threads, "load_seconds": load_s, "elapsed_seconds": elapsed,
            "output_tokens": generated, "output_tok_s": generated / elapsed, "requests": len(token_times),
            "capped": len(token_times) < len(prompts), "max_seconds": max_seconds, "token_times": token_times}


def load_hf_model(model: str, hf_config, dtype, device):
    """transformers' model of a pagoda model source: a directory, or a .gguf file (dequantized by
    transformers' GGUF loader); random weights of ``hf_config`` when ``model`` is None."""
    import torch
    from transformers import AutoModelForCausalLM

    if model is None:
        config = hf_config.to_hf() if hasattr(hf_config, "to_hf") else hf_config
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    path = Path(model)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).to(device)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device)


def run_hf_streamed(model: str, hf_config, prompts: list[list[int]], output_len: int, device, dtype,
                    max_seconds: float) -> dict:
    """HF transformers ``generate`` on one prompt at a time, each token timed through a streamer."""
    import torch

    t0 = time.perf_counter()
    hf = load_hf_model(model, hf_config, dtype, device).eval()
    load_s = time.perf_counter() - t0

    class Clock:
        def __init__(self):
            self.start, self.times, self.prompt_seen = time.perf_counter(), [], False

        def put(self, value):
            if not self.prompt_seen:  # generate() first hands the streamer the prompt
                self.prompt_seen = True
                return
            self.times.append(time.perf_counter() - self.start)

        def end(self):
            pass

    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    token_times, t1 = [], time.perf_counter()
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0][:8]], device=device), max_new_tokens=2, min_new_tokens=2, **kwargs)
        t1 = time.perf_counter()
        for prompt in prompts:
            clock = Clock()
            hf.generate(torch.tensor([prompt], device=device), max_new_tokens=output_len, min_new_tokens=output_len,
                        streamer=clock, **kwargs)
            token_times.append(clock.times)
            if time.perf_counter() - t1 > max_seconds:
                break
    elapsed = time.perf_counter() - t1
    generated = sum(len(t) for t in token_times)
    del hf
    return {"engine": "transformers", "load_seconds": load_s, "elapsed_seconds": elapsed, "output_tokens": generated,
            "output_tok_s": generated / elapsed, "requests": len(token_times),
            "capped": len(token_times) < len(prompts), "max_seconds": max_seconds, "token_times": token_times}


def latency_summary(token_times: list[list[float]]) -> dict:
    """ms percentiles of time to first token, inter-token latency and end-to-end time over requests."""
    from pagoda.bench.serve import percentiles

    ttft = [t[0] for t in token_times if t]
    itl = [b - a for t in token_times for a, b in zip(t, t[1:])]
    e2e = [t[-1] for t in token_times if t]
    ms = lambda d: {k: (None if v is None else v * 1000.0) for k, v in d.items()}  # noqa: E731
    return {"ttft": ms(percentiles(ttft)), "itl": ms(percentiles(itl)), "e2e": ms(percentiles(e2e))}
