"""The torch reference of every kernel op: correct on any device, and the floor.

All ops are functional (they return new tensors) except ``store_kv_cache``, which writes
into the cache. Shapes: T tokens in the flattened batch, H hidden size.
"""

from __future__ import annotations

import torch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N]: an unquantized layer's product (torch's, which a
    platform may replace where its own kernel is faster, e.g. pagoda-cuda's for a few rows)."""
    return torch.nn.functional.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H], weight [H] -> [T, H]; variance in float32, as HF transformers does."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum is in the activation dtype."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """x [T, H], weight [H] -> [T, H]: x normalised in float32, times ``offset + weight`` in float32,
    rounded once to x's dtype (Gemma's ``(1 + w)`` norm with offset 1; GPT-OSS's norm, whose
    float32 weight multiplies before the rounding, with offset 0), as HF transformers does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (offset + weight.float())).to(x.dtype)


def fused_add_rms_norm_offset(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_offset(x + residual), x + residual); the sum is in the activation dtype."""
    summed = x + residual
    return rms_norm_offset(summed, weight, eps, offset), summed


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rotary_dim`` dims of every head of q [T, nq*hs] and k [T, nk*hs].

    cos_sin_cache [P, rotary_dim] float32 holds cos in the first half, sin in the second, for
    each row index; ``positions`` [T] are row indices into it (a scaled rope folds its scaling
    into the cache). is_neox: rotate halves (x1 = first half, x2 = second half); otherwise
    rotate interleaved pairs (x1 = even dims, x2 = odd dims).
    """
    cos_sin = cos_sin_cache.index_select(0, positions.long())
    rot = cos_sin.shape[-1]
    cos, sin = cos_sin[:, None, : rot // 2], cos_sin[:, None, rot // 2:]

    def apply(x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        xh = x.view(t, -1, head_size)
        xr = xh[..., :rot].float()
        if is_neox:
            x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        if rot == head_size:
            return out.to(x.dtype).view(t, -1)
        return torch.cat((out.to(x.dtype), xh[..., rot:]), dim=-1).view(t, -1)

    return apply(q), apply(k)


def qk_norm_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, eps: float, head_size: int, cos_sin_cache: torch.Tensor,
                   is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of every head of q [T, nq*hs] and k [T, nk*hs] (weights [hs]; views into a fused
    projection allowed), then ``rotary_embedding`` -> ([T, nq*hs], [T, nk*hs]) (Qwen3's q/k
    norms). This fallback composes the platform's own ``rms_norm`` and ``rotary_embedding`` ops."""
    from pagoda.kernels import get_op

    t = q.shape[0]  # heads as rows of a contiguous 2-D tensor: the form every rms_norm takes
    qn = get_op("rms_norm")(q.reshape(-1, head_size), q_weight, eps).view(t, -1)
    kn = get_op("rms_norm")(k.reshape(-1, head_size), k_weight, eps).view(t, -1)
    return get_op("rotary_embedding")(positions, qn, kn, head_size, cos_sin_cache, is_neox)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:]."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> gelu_tanh(x[:, :I]) * x[:, I:]."""
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Write k, v [T, nk, hs] into kv_cache [2, num_blocks, block_size, nk, hs] at the flat
    slots ``slot_mapping`` [T] (block * block_size + offset); slots < 0 are skipped (padding).
    A quantized (fp8) cache gets float32 0-dim ``k_scale``/``v_scale``: it stores
    ``clamp(k / k_scale)`` to the fp8 range, rounded to nearest."""
    if k_scale is not None:
        limit = torch.finfo(kv_cache.dtype).max
        k = (k.float() / k_scale).clamp(-limit, limit)
        v = (v.float() / v_scale).clamp(-limit, limit)
    nk, hs = kv_cache.shape[-2], kv_cache.shape[-1]
    k_flat = kv_cache[0].view(-1, nk, hs)
    v_flat = kv_cache[1].view(-1, nk, hs)
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if kv_cache.dtype.itemsize == 1 and kv_cache.dtype.is_floating_point:  # no fp8 index_copy_ on cpu
        k_flat, v_flat, k, v = (t.view(torch.uint8) for t in (k_flat, v_flat, k, v))
    k_flat.index_copy_(0, slots, k)
    v_flat.index_copy_(0, slots, v)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE routing: router_logits [T, E] -> (weights [T, K] float32, ids [T, K] int64), the
    ``top_k`` largest of the float32 softmax over experts in descending order, optionally
    renormalised to sum to 1, times ``scaling_factor`` (HF Qwen2MoeTopKRouter)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling_factor != 1.0:
        weights = weights * scaling_factor
    return weights, ids


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Mixture-of-experts MLP, tokens grouped by expert.

    hidden [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights
    [T, K] (float32) and topk_ids [T, K] (integer) from the router. Returns [T, H] =
    sum_k topk_weights[t, k] * (w2[e] @ act_and_mul(w13[e] @ hidden[t] + w13_bias[e]) + w2_bias[e])
    with e = topk_ids[t, k] (biases [E, 2I] and [E, H] optional, GPT-OSS), the weighting done in
    the activation dtype. ``activation``: silu, gelu_tanh or swigluoai (GPT-OSS's clamped
    SwiGLU). Ids outside [0, E) contribute nothing: with expert parallelism the layer maps
    experts held by other ranks to -1.
    """
    return grouped_experts(hidden, topk_weights, topk_ids, w13.shape[0], activation,
                           lambda e: (w13[e], w2[e]), w13_bias, w2_bias)


def grouped_experts(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                    activation: str, expert_weights, w13_bias: torch.Tensor | None = None,
                    w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The body of ``fused_moe`` for any weight storage: ``expert_weights(e)`` returns expert e's
    (w13 [2I, H], w2 [H, I]) in the activation dtype, and is called only for experts in use
    (quantized methods dequantize one expert at a time through it)."""
    if activation not in _GATED_ACTS:
        raise ValueError(f"fused_moe: activation {activation!r} is not supported ({', '.join(_GATED_ACTS)})")
    act = _GATED_ACTS[activation]
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()
    flat_ids = torch.where((flat_ids >= 0) & (flat_ids < num_experts), flat_ids, num_experts)
    order = torch.argsort(flat_ids, stable=True)  # (token, k) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()
    token_of = order // k
    out = torch.zeros(t * k, hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count == 0:
            continue
        rows = order[start:start + count]
        x = hidden.index_select(0, token_of[start:start + count])
        w13, w2 = expert_weights(expert)
        gate_up = x @ w13.t() if w13_bias is None else x @ w13.t() + w13_bias[expert]
        y = act(gate_up) @ w2.t()
        out.index_copy_(0, rows, y if w2_bias is None else y + w2_bias[expert])
        start += count
    weights = topk_weights.reshape(-1, 1).to(hidden.dtype)
    return (out * weights).view(t, k, -1).sum(dim=1)


SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


def swigluoai_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU over x [T, 2I] (gate half, then up half): gate clamped to at most
    7, up to [-7, 7]; (up + 1) * gate * sigmoid(1.702 * gate)."""
    d = x.shape[-1] // 2
    gate = x[..., :d].clamp(max=SWIGLU_OAI_LIMIT)
    up = x[..., d:].clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))


_GATED_ACTS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul, "swigluoai": swigluoai_and_mul}


def store_mla_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """MLA: write the latent kv_c [T, L] and the rotated key part k_pe [T, R] into
    kv_cache [num_blocks, block_size, L + R] (latent first) at the flat slots
    ``slot_mapping`` [T]; slots < 0 are skipped (padding). A quantized (fp8) cache gets the
    layer's float32 0-dim ``scale`` (its ``kv_scales["k_scale"]``): it stores
    ``clamp(entry / scale)`` to the fp8 range, rounded to nearest."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    slots = slot_mapping.long()
    entry = torch.cat((kv_c, k_pe), dim=-1)
    if scale is not None:
        limit = torch.finfo(kv_cache.dtype).max
        entry = (entry.float() / scale).clamp(-limit, limit)
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, entry = slots[keep], entry[keep]
    entry = entry.to(kv_cache.dtype)
    if kv_cache.dtype.itemsize == 1 and kv_cache.dtype.is_floating_point:  # no fp8 index_copy_ on cpu
        flat, entry = flat.view(torch.uint8), entry.view(torch.uint8)
    flat.index_copy_(0, slots, entry)


OPS = {
    "linear": linear,
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rms_norm_offset": rms_norm_offset,
    "fused_add_rms_norm_offset": fused_add_rms_norm_offset,
    "rotary_embedding": rotary_embedding,
    "qk_norm_rotary": qk_norm_rotary,
    "silu_and_mul": silu_and_mul,
    "gelu_tanh_and_mul": gelu_tanh_and_mul,
    "store_kv_cache": store_kv_cache,
    "topk_softmax": topk_softmax,
    "fused_moe": fused_moe,
    "store_mla_cache": store_mla_cache,
}
