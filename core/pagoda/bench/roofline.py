"""The physical floor of a generation workload: bytes over measured bandwidth, FLOPs over the
measured matmul rate, whichever takes longer.

As in ``/shared/BENCH_ANCHORS.md``: every decode step reads all weights (at large batches every
MoE expert is hit) and each running sequence's KV cache; prefill may overlap decode, so it adds
FLOPs but no bytes; all FLOPs pass through the matrix units. A sliding-window layer reads and
attends to at most its window (Gemma, GPT-OSS): give ``workload_floor`` the per-layer KV bytes
and windows (``ModelRunner.kv_layer_bytes()``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from pagoda.selection import platform_of


@dataclass
class Ceilings:
    bandwidth: float  # bytes/s, device copy counting bytes read + written
    matmul_flops: float  # FLOP/s of a large square matmul in the model dtype
    measured: bool


def _timed(fn, device: torch.device, repeats: int) -> float:
    sync = platform_of(device).synchronize
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> Ceilings:
    """Copy bandwidth and matmul rate measured here (about a second on a GPU)."""
    gpu = device.type == "cuda"
    numel = (1 << 29) if gpu else (1 << 24)  # 1 GiB of bf16 on a GPU
    buffers = [torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()]
    buffers.append(torch.empty_like(buffers[0]))
    seconds = _timed(lambda: buffers[1].copy_(buffers[0]), device, 10 if gpu else 3)
    bandwidth = 2 * numel * 2 / seconds
    buffers.clear()
    n = 8192 if gpu else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _timed(lambda: a @ b, device, 10 if gpu else 2)
    return Ceilings(bandwidth, 2 * n ** 3 / seconds, True)


@dataclass
class Workload:
    num_prompts: int
    input_len: int
    output_len: int


def model_counts(model, hf_config) -> dict:
    """Parameter bytes, matmul parameters per token (MoE: the active share of the experts)
    and the LM head size, from the built model and its config."""
    weight_bytes = 0
    expert_params = 0
    embed_params = 0
    dense_params = 0
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        weight_bytes += p.numel() * p.element_size()
        if ".experts." in name or name.endswith(("w13_weight", "w2_weight")):
            expert_params += p.numel()
        elif "embed_tokens" in name:
            embed_params += p.numel()
        else:
            dense_params += p.numel()
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "n_routed_experts", None) or 0
    topk = getattr(hf_config, "num_experts_per_tok", None) or 0
    active_expert = expert_params * topk / experts if experts else expert_params
    vocab, hidden = hf_config.vocab_size, hf_config.hidden_size
    lm_head = vocab * hidden
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    # matmul parameters a token passes through, without the LM head (applied to sampled rows only)
    per_token = dense_params + active_expert - (0 if tied else lm_head)
    return {"weight_bytes": weight_bytes, "matmul_params_per_token": per_token, "lm_head_params": lm_head,
            "expert_params": expert_params}


def attention_dims(hf_config) -> tuple[int, int, int]:
    """(layers, query heads, QK+PV width per head) for attention FLOPs."""
    layers = hf_config.num_hidden_layers
    heads = hf_config.num_attention_heads
    if getattr(hf_config, "kv_lora_rank", None):  # MLA over the latent: scores and values in latent width
        width = hf_config.kv_lora_rank + hf_config.qk_rope_head_dim + hf_config.kv_lora_rank
    else:
        head = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        width = 2 * head
    return layers, heads, width


def _keys_seen(length: int, window: int | None) -> float:
    """Keys the tokens at positions 0..length-1 attend to, summed: c + 1 each, at most ``window``."""
    w = length if window is None else min(window, length)
    return w * (w + 1) / 2 + (length - w) * w


def workload_floor(work: Workload, counts: dict, kv_bytes_per_token, hf_config, ceilings: Ceilings) -> dict:
    """``kv_bytes_per_token``: bytes per token of the whole cache (every layer keeps every token), or
    [(bytes per token, window or None)] per attention layer."""
    n, p, o = work.num_prompts, work.input_len, work.output_len
    layers, heads, width = attention_dims(hf_config)
    kv_layers = (kv_bytes_per_token if isinstance(kv_bytes_per_token, (list, tuple))
                 else [(kv_bytes_per_token / layers, None)] * layers)
    # decode step s (0..o-1) reads every weight and each sequence's p + s cached tokens (at most a window)
    kv_bytes = sum(b * n * sum(p + s if w is None else min(p + s, w) for s in range(o)) for b, w in kv_layers)
    decode_bytes = o * counts["weight_bytes"] + kv_bytes
    tokens = n * (p + o)
    # token at position c attends to c + 1 keys (at most a window): 2 FLOPs per multiply-add, QK and PV
    attn_flops = 2 * heads * width * n * sum(_keys_seen(p + o, w) for _, w in kv_layers) * layers / len(kv_layers)
    flops = 2 * counts["matmul_params_per_token"] * tokens + 2 * counts["lm_head_params"] * n * o + attn_flops
    bytes_s = decode_bytes / ceilings.bandwidth
    flops_s = flops / ceilings.matmul_flops
    bound_s = max(bytes_s, flops_s)
    return {
        "decode_bytes": decode_bytes, "flops": flops, "bytes_seconds": bytes_s, "flops_seconds": flops_s,
        "bound_seconds": bound_s, "bound_by": "bytes" if bytes_s >= flops_s else "flops",
        "bound_output_tok_s": n * o / bound_s, "ceilings": asdict(ceilings),
    }
