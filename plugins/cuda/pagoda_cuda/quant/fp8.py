"""Triton kernels for FP8 W8A8: activation quantization and the two scaled GEMMs.

  quantize_fp8_groups(x [M, K], group)  -> (q fp8 [M, K], scale f32 [M, ceil(K/group)])
      group = K gives per-token scales, group = 128 DeepSeek's per-token-group scales.
  fp8_gemm(a_q, a_scale [M,1] or [1,1], w fp8 [N, K], w_scale [N], bias, out_dtype)
      acc = a_q @ w^T in float32 on the tensor cores, then * a_scale[m] * w_scale[n].
  fp8_block_gemm(a_q, a_scale [M, K/bk], w fp8 [N, K], w_scale [N/bn, K/bk], block, bias, out_dtype)
      per K-block: acc += (a_q @ w^T) * a_scale[m, kb] * w_scale[n // bn, kb].

All math after loads is in float32 (the interpreter cannot compute on bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pagoda_quant.formats.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

from pagoda_cuda import _triton  # noqa: F401  (interpreter fix under TRITON_INTERPRET=1)


@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, K, GROUP, stride_xm, stride_qm, stride_sm,
                         FP8_LIMIT: tl.constexpr, SCALE_FLOOR: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    grp = tl.program_id(1)
    start = grp * GROUP
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, GROUP, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        cols = start + idx
        mask = (idx < GROUP) & (cols < K)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_LIMIT, SCALE_FLOOR)
    tl.store(s_ptr + row * stride_sm + grp, scale)
    for off in range(0, GROUP, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        cols = start + idx
        mask = (idx < GROUP) & (cols < K)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_LIMIT), FP8_LIMIT)
        tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = min(triton.next_power_of_2(group), 1024)
    _quant_groups_kernel[(m, groups)](x, q, scale, k, group, x.stride(0), q.stride(0), scale.stride(0),
                                      FP8_LIMIT=FP8_MAX, SCALE_FLOOR=MIN_SCALE, BLOCK=block)
    return q, scale


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped program order: GROUP_M row tiles share each column tile (L2 reuse of weights)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _fp8_gemm_kernel(a_ptr, w_ptr, c_ptr, as_ptr, ws_ptr, bias_ptr, M, N, K,
                     stride_am, stride_wn, stride_cm, stride_asm,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]  # W^T tile [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    a_s = tl.load(as_ptr + offs_m * stride_asm, mask=offs_m < M, other=0.0)
    w_s = tl.load(ws_ptr + offs_n, mask=offs_n < N, other=0.0)
    acc = acc * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _fp8_block_gemm_kernel(a_ptr, w_ptr, c_ptr, as_ptr, ws_ptr, bias_ptr, M, N, K, BLOCK_SN,
                           stride_am, stride_wn, stride_cm, stride_asm, stride_wsn,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # BLOCK_K equals the scale block along K: one (a_scale, w_scale) pair per iteration
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]
    as_ptrs = as_ptr + offs_m * stride_asm
    ws_ptrs = ws_ptr + (offs_n // BLOCK_SN) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = (kb * BLOCK_K + offs_k) < K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=offs_m < M, other=0.0)
        w_s = tl.load(ws_ptrs + kb, mask=offs_n < N, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _tiles(m: int) -> tuple[int, int]:
    """(BLOCK_M, num_warps) for M rows: small decode batches use thin tiles."""
    if m <= 16:
        return 16, 4
    if m <= 64:
        return 64, 4
    return 128, 8


def fp8_gemm(a_q: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    m, k = a_q.shape
    n = w.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0:
        return c
    block_m, warps = _tiles(m)
    block_n, block_k = 128, 128
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    stride_as = a_scale.stride(0) if a_scale.shape[0] == m else 0  # static scale: one for all rows
    _fp8_gemm_kernel[grid](a_q, w, c, a_scale, w_scale, bias if bias is not None else c, m, n, k,
                           a_q.stride(0), w.stride(0), c.stride(0), stride_as,
                           HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                           GROUP_M=8, num_warps=warps, num_stages=3)
    return c


def fp8_block_gemm(a_q: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   block: tuple[int, int], bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    m, k = a_q.shape
    n = w.shape[0]
    bn, bk = block
    c = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0:
        return c
    block_m, warps = _tiles(m)
    block_n = min(bn, 128)
    if bn % block_n or bk < 16 or bk & (bk - 1):
        raise ValueError(f"fp8_block_gemm needs power-of-two block sizes >= 16, got {block}")
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_block_gemm_kernel[grid](a_q, w, c, a_scale, w_scale, bias if bias is not None else c, m, n, k, bn,
                                 a_q.stride(0), w.stride(0), c.stride(0), a_scale.stride(0), w_scale.stride(0),
                                 HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
                                 GROUP_M=8, num_warps=warps, num_stages=3)
    return c
