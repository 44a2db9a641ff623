"""Triton kernels for INT4 weight-only (W4A16) matmuls over pagoda's packed layout.

  int4_gemm(x [M, K], qweight int32 [K/8, N], scales [K/G, N], zeros [K/G, N], bias, split_k)
      dequantizes each [BLOCK_K, BLOCK_N] weight tile in registers — w = (q - z) * s, in
      float32, rounded once to the activation dtype — and multiplies on the tensor cores.
      ``split_k`` > 1 spreads K over more programs (small decode batches) and sums the
      partial tiles with float32 atomics.
  int4_dequantize(qweight, scales, zeros) -> W^T [K, N] in the scales' dtype, for large
      batches where one dequantization plus a dense matmul is faster.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_quant.kernels._triton import interpreting


@triton.jit
def _dequant_tile(qw_ptr, s_ptr, z_ptr, offs_k, offs_n, K, N, GROUP, stride_qk, stride_sg, stride_zg):
    """The dequantized float32 tile W^T[offs_k, offs_n]."""
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    packed = tl.load(qw_ptr + (offs_k[:, None] // 8) * stride_qk + offs_n[None, :], mask=mask, other=0)
    q = (packed >> ((offs_k[:, None] % 8) * 4)) & 0xF
    g = offs_k // GROUP
    s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g[:, None] * stride_zg + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    return (q.to(tl.float32) - z) * s


@triton.jit
def _int4_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, c_ptr, bias_ptr, M, N, K, GROUP,
                      stride_xm, stride_qk, stride_sg, stride_zg, stride_cm,
                      HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, SPLIT_K: tl.constexpr, UPCAST: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        w = _dequant_tile(qw_ptr, s_ptr, z_ptr, offs_k, offs_n, K, N, GROUP, stride_qk, stride_sg, stride_zg)
        w = w.to(x.dtype)  # the one rounding of the weight, as the reference does
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    if ATOMIC:
        tl.atomic_add(c_ptrs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, K, N, GROUP, stride_qk, stride_sg, stride_zg, stride_ok,
                         BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = _dequant_tile(qw_ptr, s_ptr, z_ptr, offs_k, offs_n, K, N, GROUP, stride_qk, stride_sg, stride_zg)
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_k[:, None] * stride_ok + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def _config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps) by batch size, without autotuning."""
    if m <= 16:
        block_m, block_n, block_k, warps = 16, 64, 128, 4
        tiles = triton.cdiv(n, block_n)
        split = max(1, min(8, 256 // max(tiles, 1), k // block_k))  # enough programs to fill the GPU
        return block_m, block_n, block_k, split, warps
    if m <= 64:
        return 64, 64, 64, 1, 4
    return 128, 128, 32, 1, 8


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              bias: torch.Tensor | None, split_k: int | None = None) -> torch.Tensor:
    m, k = x.shape
    n = qweight.shape[1]
    group = k // scales.shape[0]
    block_m, block_n, block_k, split, warps = _config(m, n, k)
    split = split if split_k is None else split_k
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    atomic = split > 1
    c = torch.zeros((m, n), dtype=torch.float32, device=x.device) if atomic else \
        torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    _int4_gemm_kernel[grid](x, qweight, scales, zeros, c, bias if bias is not None else c, m, n, k, group,
                            x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), c.stride(0),
                            HAS_BIAS=bias is not None, ATOMIC=atomic, SPLIT_K=split, UPCAST=interpreting(),
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=3)
    if atomic:
        if bias is not None:
            c += bias.float()
        c = c.to(x.dtype)
    return c


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    group = k // scales.shape[0]
    out = torch.empty((k, n), dtype=scales.dtype, device=qweight.device)
    block_k, block_n = 64, 128
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _int4_dequant_kernel[grid](qweight, scales, zeros, out, k, n, group, qweight.stride(0), scales.stride(0),
                               zeros.stride(0), out.stride(0), BLOCK_K=block_k, BLOCK_N=block_n, num_warps=4)
    return out
