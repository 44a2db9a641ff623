"""``linear`` for a few rows (decode at small batch): y [M, N] = x [M, K] @ W [N, K].T (+ bias).

At M <= SKINNY_ROWS cuBLAS reads a decoder's weights at a fraction of the memory rate on an H200
(1.2-1.6 TB/s at Qwen3-0.6B's shapes, batch 1; docs/benchmarks.md): its small-M kernels use few
programs or split K over a second reduction launch. Here each program owns BLOCK_N output columns
for every row and walks the whole K, BLOCK_K at a time, with the loads of later steps in flight
(num_stages), so that one launch streams the weight once, aiming at the memory rate. The rows are padded
to 16 for the tensor cores (the products are free: the weight's bytes are the cost). float32
accumulation; the result rounds to the input dtype as torch's. Larger M goes to torch (cuBLAS).

It runs for products of at most ``PAGODA_CUDA_SKINNY_ROWS`` rows (read at import; by default 16 where programmatic
dependent launch is on, ``pagoda_cuda.switches``) of weights of at most SKINNY_MAX_WEIGHT_BYTES; otherwise the
``linear`` op is torch's. Measured on an H200 (docs/benchmarks.md, nineteenth session; with PDL): as fast as
cuBLAS or faster at Qwen3-0.6B's layers (4-13 MB; batch-1 decode 1.43 -> 1.20 ms a token with it), 5-29% slower
at Phi-3-mini's 50-100 MB layers. ``scripts/skinny_linear_probe.py`` times it against cuBLAS at decode shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_cuda._triton import interpreting, pdl, sm_count, wait_for_inputs
from pagoda_cuda.switches import MAX_SKINNY_ROWS, lenient, skinny_rows

SKINNY_ROWS = lenient(skinny_rows, 0)  # up to this many rows the Triton kernel runs; above, torch's linear
# the largest weight it takes: above, cuBLAS streamed the weight faster in the measurements (module docstring)
SKINNY_MAX_WEIGHT_BYTES = 16 << 20


@triton.jit
def _dot_rows(x, w, NATIVE: tl.constexpr):
    """x [BLOCK_M, k] @ w [BLOCK_N, k].T, float32."""
    if NATIVE:  # bf16 / fp16 on the tensor cores, float32 sums
        return tl.dot(x, tl.trans(w))
    else:  # float32 models, and the interpreter (which computes bf16 wrongly)
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")


@triton.jit
def _skinny_kernel(x_ptr, x_stride, w_ptr, w_stride, b_ptr, y_ptr, y_stride, M, N, K,
                   HAS_BIAS: tl.constexpr, NATIVE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE_K: tl.constexpr, PDL: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * w_stride
    x_rows = x_ptr + rows[:, None] * x_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PRE_K > 0:
        # the first PRE_K columns of this program's weight rows are loaded before the wait: the weights do not
        # change during a forward, so under programmatic dependent launch they stream in while the kernel
        # before this one still runs (the activations are read only after the wait)
        pre = tl.arange(0, PRE_K)
        w_pre = tl.load(w_rows + pre[None, :], mask=col_ok[:, None] & (pre[None, :] < K), other=0.0)
        wait_for_inputs(PDL)
        x_pre = tl.load(x_rows + pre[None, :], mask=row_ok[:, None] & (pre[None, :] < K), other=0.0)
        acc += _dot_rows(x_pre, w_pre, NATIVE)
    else:
        wait_for_inputs(PDL)
    lanes = tl.arange(0, BLOCK_K)
    for k0 in range(PRE_K, K, BLOCK_K):
        ks = k0 + lanes
        k_ok = ks < K
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        acc += _dot_rows(x, w, NATIVE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows[:, None] * y_stride + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


PREFETCH_ELEMENTS = 16384  # weight elements a program loads before its wait (32 KB of bf16: 64 registers a thread)


def prefetch_columns(n_block: int, k: int) -> int:
    """PRE_K: the leading columns of K a program loads before waiting (a power of two, within
    PREFETCH_ELEMENTS and K)."""
    fits = PREFETCH_ELEMENTS // n_block
    return min(fits, 1 << (max(16, k).bit_length() - 1))


def skinny_config(n: int, k: int, programs: int = 132) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): column blocks as narrow as it takes for about one program per
    multiprocessor (each then streams its rows of the weight with four steps of loads in flight), 16 at
    the narrowest (one tensor-core tile)."""
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) < programs:
        block_n //= 2
    return block_n, 256 if k >= 256 else max(16, triton.next_power_of_2(k)), 4, 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None, prefetch: bool | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] in x's dtype, for at most MAX_SKINNY_ROWS rows
    (16: the kernel pads its rows to one tensor-core tile). ``prefetch`` (default: under programmatic
    dependent launch) loads the leading weight columns before the kernel waits for its inputs."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, k = x2.shape
    n = w.shape[0]
    if m > MAX_SKINNY_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_SKINNY_ROWS} rows, not {m}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        block_n, block_k, warps, stages = config or skinny_config(n, k, sm_count(x.device))
        native = x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16) and not interpreting()
        early = pdl(x.device)
        pre_k = prefetch_columns(block_n, k) if (early if prefetch is None else prefetch) else 0
        _skinny_kernel[(triton.cdiv(n, block_n),)](
            x2, x2.stride(0), w, w.stride(0), bias if bias is not None else w, y, y.stride(0), m, n, k,
            HAS_BIAS=bias is not None, NATIVE=native, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, PRE_K=pre_k,
            PDL=early, num_warps=warps, num_stages=stages, launch_pdl=early)
    return y.view(*shape[:-1], n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``linear`` kernel op: the Triton kernel for at most SKINNY_ROWS rows of a weight of at most
    SKINNY_MAX_WEIGHT_BYTES, torch's linear otherwise."""
    if (SKINNY_ROWS and x.numel() // max(1, x.shape[-1]) <= SKINNY_ROWS and x.dtype == weight.dtype
            and weight.numel() * weight.element_size() <= SKINNY_MAX_WEIGHT_BYTES):
        return skinny_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)
