"""The HF transformers baseline: ``generate`` on the same shape and workload, in this process.

Random weights of the same config (a model directory's own weights when it has them), one
batch of all prompts, greedy, EOS ignored (``min_new_tokens``), stopped after ``max_seconds``
(``generate(max_time=...)``) so a slow baseline cannot eat a GPU lease.
"""

from __future__ import annotations

import time

import torch

from pagoda.selection import platform_of


def run_hf_baseline(hf_config, model_dir: str | None, prompts: list[list[int]], output_len: int,
                    device: torch.device, dtype: torch.dtype, max_seconds: float) -> dict:
    from pagoda.bench.baselines import load_hf_model

    t0 = time.perf_counter()
    model = load_hf_model(model_dir, hf_config, dtype, device)  # a directory, a .gguf file, or random weights
    model.eval()
    load_s = time.perf_counter() - t0
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        with torch.inference_mode():
            model.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
            platform_of(device).synchronize()
            t1 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len,
                                 max_time=max_seconds, **kwargs)
            platform_of(device).synchronize()
            elapsed = time.perf_counter() - t1
    finally:
        del model
        platform_of(device).empty_cache()
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {
        "engine": "transformers", "load_seconds": load_s, "elapsed_seconds": elapsed,
        "output_tokens": int(generated), "output_tok_s": generated / elapsed,
        "total_tok_s": (generated + ids.numel()) / elapsed,
        "capped": bool(out.shape[1] - ids.shape[1] < output_len), "max_seconds": max_seconds,
    }
