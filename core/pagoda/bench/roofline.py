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


def measure_bandwidth(device: torch.device) -> float:
    """Device copy bandwidth measured here, bytes read + written per second: 1 GiB of bf16 copied on a
    GPU, 32 MiB elsewhere (a CPU: a torch copy timed the same way), best of a few."""
    gpu = device.type == "cuda"
    numel = (1 << 29) if gpu else (1 << 24)
    src = torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), device, 10 if gpu else 3)
    return 2 * numel * 2 / seconds


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> Ceilings:
    """Copy bandwidth and matmul rate measured here (about a second on a GPU)."""
    gpu = device.type == "cuda"
    bandwidth = measure_bandwidth(device)
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


def _kv_layers(kv_bytes_per_token, layers: int) -> list[tuple[float, int | None]]:
    """[(bytes per token, window or None)] per attention layer, from either form ``workload_floor`` takes."""
    if isinstance(kv_bytes_per_token, (list, tuple)):
        return list(kv_bytes_per_token)
    return [(kv_bytes_per_token / layers, None)] * layers


def decode_kv_bytes(work: Workload, kv_layers) -> float:
    """KV cache bytes the workload's decode steps read: step s (0..o-1) reads each sequence's p + s
    cached tokens of every layer (at most the layer's window)."""
    n, p, o = work.num_prompts, work.input_len, work.output_len
    return sum(b * n * sum(p + s if w is None else min(p + s, w) for s in range(o)) for b, w in kv_layers)


def decode_step_floor(work: Workload, counts: dict, kv_bytes_per_token, hf_config, bandwidth: float,
                      measured: bool) -> dict:
    """The floor of one decode step of ``work.num_prompts`` sequences (``pagoda bench latency``): every
    weight read once plus the batch's KV cache at the mean context of the decode steps (input_len +
    (output_len - 1) / 2, window layers capped), over ``bandwidth`` (bytes/s)."""
    kv = decode_kv_bytes(work, _kv_layers(kv_bytes_per_token, hf_config.num_hidden_layers)) / work.output_len
    step = counts["weight_bytes"] + kv
    return {"itl_ms": 1000.0 * step / bandwidth, "step_bytes": step, "weight_bytes": counts["weight_bytes"],
            "kv_bytes": kv, "bandwidth": bandwidth, "bandwidth_measured": measured}


def workload_floor(work: Workload, counts: dict, kv_bytes_per_token, hf_config, ceilings: Ceilings) -> dict:
    """``kv_bytes_per_token``: bytes per token of the whole cache (every layer keeps every token), or
    [(bytes per token, window or None)] per attention layer."""
    n, p, o = work.num_prompts, work.input_len, work.output_len
    layers, heads, width = attention_dims(hf_config)
    kv_layers = _kv_layers(kv_bytes_per_token, layers)
    decode_bytes = o * counts["weight_bytes"] + decode_kv_bytes(work, kv_layers)
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
