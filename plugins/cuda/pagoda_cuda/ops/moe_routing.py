"""Softmax top-k MoE routing in one launch (the torch version takes four: softmax, topk,
sum, divide; once per MoE layer and step they cost more than the work at decode sizes).

One program routes BLOCK_T tokens: the float32 softmax over the (padded) experts, then
``TOPK`` rounds of "take the largest, mask it out", which yields the experts in descending
order like ``torch.topk`` (ties go to the lower expert id), then the optional
renormalisation and scaling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_cuda._triton import next_pow2


@triton.jit
def _topk_softmax_kernel(logits_ptr, stride_t, weights_ptr, ids_ptr, num_tokens, num_experts, scaling,
                         TOPK: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    inside = rows < num_tokens
    valid = inside[:, None] & (experts[None, :] < num_experts)
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + experts[None, :], mask=valid,
                other=float("-inf")).to(tl.float32)
    x = tl.where(valid, x, float("-inf"))
    top = tl.max(x, axis=1)
    top = tl.where(inside, top, 0.0)  # rows past the end: keep the arithmetic finite
    e = tl.exp(x - top[:, None])
    total = tl.where(inside, tl.sum(e, axis=1), 1.0)
    probs = e / total[:, None]
    probs = tl.where(valid, probs, -1.0)  # padding experts are never chosen
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int64)
    for k in tl.static_range(TOPK):
        best = tl.max(probs, axis=1)
        # the lowest expert id holding the maximum
        chosen = tl.min(tl.where(probs == best[:, None], experts[None, :], BLOCK_E), axis=1)
        weights = tl.where(slots[None, :] == k, best[:, None], weights)
        ids = tl.where(slots[None, :] == k, chosen[:, None].to(tl.int64), ids)
        probs = tl.where(experts[None, :] == chosen[:, None], -1.0, probs)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    weights = weights * scaling
    out = rows[:, None] * TOPK + slots[None, :]
    keep = inside[:, None] & (slots[None, :] < TOPK)
    tl.store(weights_ptr + out, weights, mask=keep)
    tl.store(ids_ptr + out, ids, mask=keep)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``pagoda.kernels.reference.topk_softmax``."""
    t, num_experts = router_logits.shape
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=router_logits.device)
    if t == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    block_e = max(16, next_pow2(num_experts))
    block_t = max(1, min(16, 4096 // block_e))  # about 4096 experts' values per program
    _topk_softmax_kernel[(triton.cdiv(t, block_t),)](
        logits, logits.stride(0), weights, ids, t, num_experts, float(scaling_factor), TOPK=top_k,
        K_PAD=max(2, next_pow2(top_k)), RENORMALIZE=bool(renormalize), BLOCK_T=block_t, BLOCK_E=block_e,
        num_warps=4)
    return weights, ids
