"""Fused MoE over quantized experts (W8A16 / W4A16): the ``cuda`` ``fused_moe_quant``.

1. ``align`` (torch ops of fixed sizes: no host sync, graph-capturable): the T*K (token,
   expert) pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M, so that
   every BLOCK_M block of rows belongs to one expert (``block_expert``; E past the end).
2. gate/up: each program takes BLOCK_M gathered token rows and BLOCK_N columns of the expert's
   gate and up projections; weight tiles are dequantized in registers (w = q * s for FP8 with
   per-channel or block scales; w = (q - z) * s for INT4), rounded to the activation dtype like
   the reference, and multiplied on the tensor cores; writes act(gate) * up per padded row.
3. down: the same blocks times the expert's down projection, times each pair's routing weight,
   written per pair; 4. the K pairs of each token are summed.

Weight formats (``FORMAT``): 0 FP8 per-channel (w [E, N, K], s [E, N]); 1 FP8 block (s [E,
N/bn, K/bk]); 2 INT4 in pagoda's kernel layout (qweight [E, K/8, N], scales/zeros [E, K/G, N]),
multiplied as in ``pagoda_cuda.quant.int4`` (each packed word loaded once, eight nibble-plane dots; BLOCK_K 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_cuda._triton import gelu_tanh, interpreting, silu
from pagoda_cuda.quant.int4 import group_params, packed_tile_dot

INT4 = 2  # FORMAT of pagoda's INT4 kernel layout (see the module docstring)


@triton.jit
def _w_tile(w_ptr, s_ptr, z_ptr, expert, n, k, N, K, stride_we, stride_wa, stride_se, stride_sa,
            FORMAT: tl.constexpr, BLOCK_SN, BLOCK_SK):
    """Dequantized float32 W^T tile [len(k), len(n)] of one FP8 expert (n: outputs, k: inputs)."""
    mask = (k[:, None] < K) & (n[None, :] < N)
    e = expert.to(tl.int64)
    w = tl.load(w_ptr + e * stride_we + n[None, :].to(tl.int64) * stride_wa + k[:, None], mask=mask,
                other=0.0).to(tl.float32)
    if FORMAT == 0:  # per output channel: s [E, N]
        s = tl.load(s_ptr + e * stride_se + n, mask=n < N, other=0.0)
        return w * s[None, :]
    s = tl.load(s_ptr + e * stride_se + (n[None, :] // BLOCK_SN) * stride_sa + k[:, None] // BLOCK_SK, mask=mask,
                other=0.0)
    return w * s


@triton.jit
def _int4_expert_dot(acc, a, w_ptr, s_ptr, z_ptr, expert, n, k0, N, K, stride_we, stride_wa, stride_se, stride_sa,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ W^T[k0:k0+BLOCK_K, n] of one INT4 expert (qweight [E, K/8, N]; scales/zeros
    [E, K/G, N] share strides): the packed tile loaded once, eight nibble-plane dots."""
    e = expert.to(tl.int64)
    rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    r_mask = rows < K // 8
    n_mask = n < N
    packed = tl.load(w_ptr + e * stride_we + rows[:, None] * stride_wa + n[None, :],
                     mask=r_mask[:, None] & n_mask[None, :], other=0)
    s, z_biased = group_params(s_ptr + e * stride_se, z_ptr + e * stride_se, k0, rows, n, n_mask, r_mask, GROUP,
                               BLOCK_K, stride_sa, stride_sa)
    if a.dtype == tl.float32:  # float32 activations: no TF32 rounding
        return packed_tile_dot(acc, a, packed, s, z_biased, BLOCK_M, BLOCK_K, UPCAST, "ieee")
    return packed_tile_dot(acc, a, packed, s, z_biased, BLOCK_M, BLOCK_K, UPCAST, "tf32")


@triton.jit
def _gate_up_kernel(h_ptr, stride_ht, w_ptr, s_ptr, z_ptr, stride_we, stride_wa, stride_se, stride_sa,
                    out_ptr, stride_ot, pairs_ptr, block_expert_ptr, num_pairs, num_experts, H, inner,
                    BLOCK_SN, BLOCK_SK, GROUP: tl.constexpr, TOPK: tl.constexpr, FORMAT: tl.constexpr,
                    ACT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    rmask = pair < num_pairs
    token = (pair // TOPK).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dtype = out_ptr.dtype.element_ty
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(h_ptr + token[:, None] * stride_ht + k[None, :], mask=rmask[:, None] & (k[None, :] < H),
                    other=0.0)
        # up rows follow the gate rows; a column past the gate's end lands past 2 * inner: masked
        if FORMAT == 2:
            acc_gate = _int4_expert_dot(acc_gate, a, w_ptr, s_ptr, z_ptr, expert, n, k0, inner, H, stride_we,
                                        stride_wa, stride_se, stride_sa, GROUP, BLOCK_M, BLOCK_K, UPCAST)
            acc_up = _int4_expert_dot(acc_up, a, w_ptr, s_ptr, z_ptr, expert, inner + n, k0, 2 * inner, H,
                                      stride_we, stride_wa, stride_se, stride_sa, GROUP, BLOCK_M, BLOCK_K, UPCAST)
        else:
            wg = _w_tile(w_ptr, s_ptr, z_ptr, expert, n, k, inner, H, stride_we, stride_wa, stride_se, stride_sa,
                         FORMAT, BLOCK_SN, BLOCK_SK).to(dtype)
            wu = _w_tile(w_ptr, s_ptr, z_ptr, expert, inner + n, k, 2 * inner, H, stride_we, stride_wa, stride_se,
                         stride_sa, FORMAT, BLOCK_SN, BLOCK_SK).to(dtype)
            if UPCAST:
                a = a.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            acc_gate += tl.dot(a, wg)
            acc_up += tl.dot(a, wu)
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    if ACT == "silu":
        act = silu(gate)
    else:
        act = gelu_tanh(gate)
    y = act.to(dtype).to(tl.float32) * up
    mask = rmask[:, None] & (n[None, :] < inner)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + n[None, :], y.to(dtype), mask=mask)


@triton.jit
def _down_kernel(x_ptr, stride_xt, w_ptr, s_ptr, z_ptr, stride_we, stride_wa, stride_se, stride_sa,
                 out_ptr, stride_ot, pairs_ptr, block_expert_ptr, weights_ptr, num_pairs, num_experts, H, inner,
                 BLOCK_SN, BLOCK_SK, GROUP: tl.constexpr, FORMAT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    rmask = pair < num_pairs
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inner, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xt + k[None, :],
                    mask=rmask[:, None] & (k[None, :] < inner), other=0.0)
        if FORMAT == 2:
            acc = _int4_expert_dot(acc, a, w_ptr, s_ptr, z_ptr, expert, n, k0, H, inner, stride_we, stride_wa,
                                   stride_se, stride_sa, GROUP, BLOCK_M, BLOCK_K, UPCAST)
        else:
            w = _w_tile(w_ptr, s_ptr, z_ptr, expert, n, k, H, inner, stride_we, stride_wa, stride_se, stride_sa,
                        FORMAT, BLOCK_SN, BLOCK_SK).to(dtype)
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(a, w)
    route = tl.load(weights_ptr + pair, mask=rmask, other=0.0).to(dtype).to(tl.float32)
    y = acc.to(dtype).to(tl.float32) * route[:, None]
    mask = rmask[:, None] & (n[None, :] < H)
    tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_ot + n[None, :], y.to(dtype), mask=mask)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sorted pair ids [padded rows] with num_pairs as filler, expert of each block, num_pairs):
    ``pagoda.layers.moe_grouping.group_pairs_by_expert``'s grouping."""
    from pagoda.layers.moe_grouping import group_pairs_by_expert

    pairs, block_expert, _ = group_pairs_by_expert(topk_ids, num_experts, block_m)
    return pairs, block_expert, topk_ids.numel()


def _weight_args(w) -> tuple:
    """(FORMAT, weight, scales, zeros, strides..., BLOCK_SN, BLOCK_SK, GROUP) of ExpertWeights."""
    fmt, weight, scales, zeros, block, group = w.kernel_tensors()
    zeros = zeros if zeros is not None else scales
    return (fmt, weight, scales, zeros, weight.stride(0), weight.stride(1), scales.stride(0),
            scales.stride(1) if scales.dim() > 2 else 0, block[0], block[1], group)


def fused_moe_quant(hidden: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    activation: str = "silu") -> torch.Tensor:
    t, topk = topk_ids.shape
    h = hidden.shape[-1]
    num_experts = w13.num_experts
    inner = w2.in_features
    f13, wt13, s13, z13, swe, swa, sse, ssa, bn, bk, g13 = _weight_args(w13)
    f2, wt2, s2, z2, swe2, swa2, sse2, ssa2, bn2, bk2, g2 = _weight_args(w2)
    if (f13 == INT4 and g13 % 8) or (f2 == INT4 and g2 % 8):  # a group inside a packed word: dequantize
        from pagoda.kernels import get_op

        return get_op("fused_moe")(hidden, w13.dequantize_all(hidden.dtype), w2.dequantize_all(hidden.dtype),
                                   topk_weights, topk_ids, activation)
    block_m = 16 if t * topk < 32 * num_experts else 64  # few rows per expert: less padding
    block_n = 64
    pairs, block_expert, num_pairs = align(topk_ids, num_experts, block_m)
    up = torch.empty((pairs.numel(), inner), dtype=hidden.dtype, device=hidden.device)
    upcast = interpreting()
    block_k = 128 if f13 == INT4 else 64  # INT4: 16 packed rows, the depth of one nibble-plane dot
    grid = (block_expert.numel(), triton.cdiv(inner, block_n))
    _gate_up_kernel[grid](hidden, hidden.stride(0), wt13, s13, z13, swe, swa, sse, ssa, up, up.stride(0), pairs,
                          block_expert, num_pairs, num_experts, h, inner, bn, bk, g13, TOPK=topk, FORMAT=f13,
                          ACT=activation, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast,
                          num_warps=4)
    out = torch.zeros((num_pairs, h), dtype=hidden.dtype, device=hidden.device)
    block_k = 128 if f2 == INT4 else 64
    grid = (block_expert.numel(), triton.cdiv(h, block_n))
    _down_kernel[grid](up, up.stride(0), wt2, s2, z2, swe2, swa2, sse2, ssa2, out, out.stride(0), pairs, block_expert,
                       topk_weights.reshape(-1).contiguous(), num_pairs, num_experts, h, inner, bn2, bk2, g2,
                       FORMAT=f2, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, num_warps=4)
    return out.view(t, topk, h).sum(dim=1)
