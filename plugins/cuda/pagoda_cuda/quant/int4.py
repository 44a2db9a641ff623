"""Triton kernels for INT4 weight-only (W4A16) matmuls over pagoda's packed layout.

  int4_gemm(x [M, K], qweight int32 [K/8, N], scales [K/G, N], zeros [K/G, N], bias, split_k)
      the fused dequantize-GEMM for small batches (decode), memory-bound on the weight bytes.
  int4_dequantize(qweight, scales, zeros) -> W^T [K, N] in the scales' dtype, for large
      batches where one dequantization plus a dense matmul is faster.

Every weight byte is loaded once. A program loads a packed tile [BLOCK_K/8, BLOCK_N] (rows
of int32 words, contiguous along N: coalesced 16-byte loads); word row r holds the eight
input rows k0 + 8r + j (nibble j). For each j the kernel dequantizes that nibble plane,
w_j = (q - z) * s in float32 rounded once to the activation dtype (as the reference), and
multiplies it with the activation columns x[:, k0 + 8r + j], split in registers out of one
contiguous [BLOCK_M, BLOCK_K] activation load: acc += x_j @ w_j on the tensor cores. Scales and zero points
are read once per tile: one [1, BLOCK_N] row when a group spans the whole tile
(GROUP % BLOCK_K == 0), else one [BLOCK_K/8, BLOCK_N] load shared by the eight planes
(GROUP % 8 == 0, so the eight rows of a word share a group). The int -> float conversion
ORs the nibble into the mantissa of 2^23 (exact, no I2F instruction) and subtracts 2^23 + z.

Parallelism at decode shapes comes from split-K: SPLIT_K programs share an output tile,
each summing every SPLIT_K-th K tile, and add their float32 partials atomically into a
workspace (the bias by the first split); the last split to arrive (a per-tile counter) reads
the sum, writes the output in the activation dtype and zeroes the workspace and the counter
again. One launch per linear: no zero-fill and cast kernels around it, which at decode
sizes cost as much as the GEMM. On a
GPU the tile shapes, SPLIT_K, warps and stages are autotuned per (N, K, M bucket, group),
on the first call of a shape — in the engine that is the eager warm-up before a decode
graph is captured, never inside a capture. The interpreter runs one fixed configuration.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagoda_cuda._triton import interpreting

TWO_23 = 8388608.0  # 2^23: a float32 whose lowest mantissa bits hold an integer 0..15 exactly


@triton.jit
def group_params(s_ptr, z_ptr, k0, rows, n, n_mask, r_mask, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                  stride_sg, stride_zg):
    """(scale, 2^23 + zero) in float32 for the packed rows ``rows`` of the tile starting at k0:
    [1, BLOCK_N] when one group spans the tile, else [BLOCK_K/8, BLOCK_N] (row r: group of k0 + 8r)."""
    if GROUP % BLOCK_K == 0:
        g = k0 // GROUP
        s = tl.load(s_ptr + g * stride_sg + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        z = tl.load(z_ptr + g * stride_zg + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    else:
        g = (rows * 8) // GROUP
        mask = r_mask[:, None] & n_mask[None, :]
        s = tl.load(s_ptr + g[:, None] * stride_sg + n[None, :], mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g[:, None] * stride_zg + n[None, :], mask=mask, other=0.0).to(tl.float32)
    return s, z + 8388608.0


@triton.jit
def _nibble_plane(packed, s, z_biased, J: tl.constexpr, INTERPRET: tl.constexpr):
    """Float32 (q_J - z) * s of nibble J of every word: exact up to the one multiplication."""
    shifted = packed >> (4 * J)
    if INTERPRET:
        q = (shifted & 0xF) | 0x4B000000
    else:  # one LOP3, (a & 0xF) | 0x4B000000, where LLVM would emit a bit-field extract (2 ops) and an OR
        q = tl.inline_asm_elementwise("lop3.b32 $0, $1, 15, 1258291200, 234;", "=r,r", [shifted],
                                      dtype=tl.int32, is_pure=True, pack=1)
    return (q.to(tl.float32, bitcast=True) - z_biased) * s  # the float 2^23 + q minus 2^23 + z: exact


@triton.jit
def _plane_dot(acc, x_j, packed, s, z_biased, J: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    w_j = _nibble_plane(packed, s, z_biased, J, UPCAST).to(x_j.dtype)  # the one rounding, as the reference
    if UPCAST:
        x_j = x_j.to(tl.float32)
        w_j = w_j.to(tl.float32)
    return tl.dot(x_j, w_j, acc, input_precision=PRECISION)


@triton.jit
def packed_tile_dot(acc, x, packed, s, z_biased, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + x @ W for an activation tile x [BLOCK_M, BLOCK_K] (contiguous K) and the packed weight
    tile [BLOCK_K/8, BLOCK_N] with its group parameters (``group_params``): the activation's column
    planes x[:, 8r + j], j = 4a + 2b + c, split out (c, then b, then a), each times nibble plane j."""
    x_c0, x_c1 = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 8, 2, 2, 2]))
    x_b00, x_b01 = tl.split(x_c0)
    x_b10, x_b11 = tl.split(x_c1)
    x_0, x_4 = tl.split(x_b00)
    x_2, x_6 = tl.split(x_b01)
    x_1, x_5 = tl.split(x_b10)
    x_3, x_7 = tl.split(x_b11)
    acc = _plane_dot(acc, x_0, packed, s, z_biased, 0, UPCAST, PRECISION)
    acc = _plane_dot(acc, x_1, packed, s, z_biased, 1, UPCAST, PRECISION)
    acc = _plane_dot(acc, x_2, packed, s, z_biased, 2, UPCAST, PRECISION)
    acc = _plane_dot(acc, x_3, packed, s, z_biased, 3, UPCAST, PRECISION)
    acc = _plane_dot(acc, x_4, packed, s, z_biased, 4, UPCAST, PRECISION)
    acc = _plane_dot(acc, x_5, packed, s, z_biased, 5, UPCAST, PRECISION)
    acc = _plane_dot(acc, x_6, packed, s, z_biased, 6, UPCAST, PRECISION)
    return _plane_dot(acc, x_7, packed, s, z_biased, 7, UPCAST, PRECISION)


@triton.jit(do_not_specialize=["M", "M_BUCKET", "SPLIT_K"])
def _int4_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, c_ptr, ws_ptr, count_ptr, bias_ptr, M, N, K, M_BUCKET,
                      stride_xm, stride_qk, stride_sg, stride_zg, stride_cm, SPLIT_K,
                      GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, UPCAST: tl.constexpr,
                      PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # M_BUCKET only keys the autotuner (one tuning per batch-size bucket, not per M)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_K // 8)
    m_mask = offs_m < M
    n_mask = offs_n < N
    packed_rows = K // 8
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        rows = k0 // 8 + offs_r  # packed rows of this tile
        r_mask = rows < packed_rows
        packed = tl.load(qw_ptr + rows[:, None] * stride_qk + offs_n[None, :],
                         mask=r_mask[:, None] & n_mask[None, :], other=0)  # [BLOCK_K/8, BLOCK_N]
        s, z_biased = group_params(s_ptr, z_ptr, k0, rows, offs_n, n_mask, r_mask, GROUP, BLOCK_K,
                                    stride_sg, stride_zg)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)
        acc = packed_tile_dot(acc, x, packed, s, z_biased, BLOCK_M, BLOCK_K, UPCAST, PRECISION)
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    if ATOMIC:
        # float32 partials summed in the workspace; the last split of the tile to arrive writes
        # the output and leaves the workspace and its counter at zero for the next call
        ws_ptrs = ws_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
        tl.atomic_add(ws_ptrs, acc, mask=mask, sem="relaxed")  # a commutative sum: no ordering needed
        tl.debug_barrier()  # every thread's partial is issued before the counter says this split is done
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            # read where the atomics summed (L2), not through a possibly stale L1 line
            total = tl.atomic_add(ws_ptrs, tl.zeros_like(acc), mask=mask, sem="acquire")
            tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=mask)
            tl.store(ws_ptrs, tl.zeros_like(acc), mask=mask)  # seen by the next launch (a kernel boundary)
            tl.store(count_ptr + tile, 0)
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, K, N, stride_qk, stride_sg, stride_zg, stride_ok,
                         GROUP: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    r_mask = rows < K // 8
    n_mask = offs_n < N
    mask = r_mask[:, None] & n_mask[None, :]
    packed = tl.load(qw_ptr + rows[:, None] * stride_qk + offs_n[None, :], mask=mask, other=0)
    s, z_biased = group_params(s_ptr, z_ptr, k0, rows, offs_n, n_mask, r_mask, GROUP, BLOCK_K, stride_sg, stride_zg)
    out_rows = out_ptr + (rows * 8)[:, None] * stride_ok + offs_n[None, :]
    for j in tl.static_range(8):  # input row 8r + j of each word row r: coalesced along N
        w_j = _nibble_plane(packed, s, z_biased, j, INTERPRET)
        tl.store(out_rows + j * stride_ok, w_j.to(out_ptr.dtype.element_ty), mask=mask)


# --- configurations --------------------------------------------------------------------------

# (BLOCK_N, BLOCK_K, num_warps, num_stages) tried per batch-size bucket; BLOCK_M follows the bucket
_TUNE_BASES = {
    16: [(32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (128, 128, 8, 4), (128, 256, 8, 2)],
    32: [(64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3)],
    64: [(64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3)],
    128: [(64, 128, 4, 3), (128, 128, 8, 3)],
}
PROGRAMS_PER_SM = 4  # split-K target: enough programs in flight to cover the memory latency


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def m_bucket(m: int) -> int:
    """The batch-size bucket that keys tuning: 16 for up to 16 rows, then powers of two to 128."""
    return min(128, max(16, triton.next_power_of_2(m)))


def split_for(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, sms: int) -> int:
    """SPLIT_K giving about PROGRAMS_PER_SM programs per SM (a power of two, each split >= 2 K tiles
    where K allows it)."""
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    want = triton.cdiv(PROGRAMS_PER_SM * sms, tiles)
    most = max(1, triton.cdiv(k, block_k) // 2)
    return max(1, min(triton.next_power_of_2(want), triton.next_power_of_2(most + 1) // 2))


def _expand_splits(configs, named_args, **kwargs):
    """Autotuner pruning, once per key: each base configuration at the heuristic SPLIT_K and twice it."""
    m, n, k = named_args["M"], named_args["N"], named_args["K"]
    sms = _num_sms(named_args["x_ptr"].device.index or 0)
    out = []
    for cfg in configs:
        bm, bn, bk = (cfg.kwargs[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        if bm != m_bucket(m):
            continue
        split = split_for(m, n, k, bm, bn, bk, sms)
        for s in sorted({split, min(2 * split, max(1, triton.cdiv(k, bk)))}):
            out.append(triton.Config({**cfg.kwargs, "SPLIT_K": s}, num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages))
    return out


def graph_bench(kernel_call, quantiles):
    """Median device time (ms) of one call as a CUDA graph replays it, L2 flushed before each
    call. A decode GEMM takes microseconds, less than its eager launch: timed eagerly every
    configuration measures the host and the choice is noise; and every decode weight fits in the
    50 MB L2, so without the flush a configuration is timed on cached weights."""
    from triton.testing import do_bench_cudagraph

    flush = torch.empty(32 << 20, dtype=torch.int32, device="cuda")  # 128 MB, over twice the L2
    torch.cuda.synchronize()  # kernels still running on other streams share the split-K workspace

    def flushed_call():
        flush.zero_()
        kernel_call()

    both = do_bench_cudagraph(flushed_call, rep=20, return_mode="median")
    alone = do_bench_cudagraph(flush.zero_, rep=20, return_mode="median")
    ms = max(both - alone, 1e-4)
    return [ms] * len(quantiles) if quantiles else ms


_TUNE_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                 for bm, bases in _TUNE_BASES.items() for bn, bk, w, s in bases]
_int4_gemm_tuned = triton.autotune(_TUNE_CONFIGS, key=["N", "K", "M_BUCKET", "GROUP"],
                                   prune_configs_by={"early_config_prune": _expand_splits},
                                   do_bench=graph_bench, cache_results=True)(_int4_gemm_kernel)


def _fixed_config(m: int, n: int, k: int, device: torch.device) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) without tuning (interpreter,
    PAGODA_QUANT_INT4_AUTOTUNE=0)."""
    if interpreting():
        return 16, 32, 128, 1, 4, 1
    bm = m_bucket(m)
    bn, bk, warps, stages = (64, 128, 4, 4) if bm == 16 else (128, 128, 8, 3)
    return bm, bn, bk, split_for(m, n, k, bm, bn, bk, _num_sms(device.index or 0)), warps, stages


# device -> every (float32 workspace, int32 tile counters) made, the last the largest. The kernel
# leaves them zero; none is freed, because captured graphs hold their addresses.
_SPLIT_WORKSPACES: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def split_workspace(device: torch.device, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed buffers for split-K sums of an [m, n] output (any tile of at least 16 x 16)."""
    need_ws, need_count = m * n, triton.cdiv(m, 16) * triton.cdiv(n, 16)
    held = _SPLIT_WORKSPACES.setdefault(device, [])
    if held and held[-1][0].numel() >= need_ws and held[-1][1].numel() >= need_count:
        return held[-1]
    size_ws = max(need_ws, 2 * held[-1][0].numel() if held else 0)
    size_count = max(need_count, 2 * held[-1][1].numel() if held else 0)
    held.append((torch.zeros(size_ws, dtype=torch.float32, device=device),
                 torch.zeros(size_count, dtype=torch.int32, device=device)))
    return held[-1]


def _autotune() -> bool:
    return not interpreting() and os.environ.get("PAGODA_QUANT_INT4_AUTOTUNE", "1") != "0"


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              bias: torch.Tensor | None, split_k: int | None = None,
              blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (unit stride along K) times the packed weight -> [M, N] in x's dtype.
    ``split_k`` / ``blocks`` (BLOCK_M, BLOCK_N, BLOCK_K; BLOCK_K >= 128) fix the configuration
    (tests); otherwise a GPU autotunes and the interpreter uses one fixed configuration."""
    m, k = x.shape
    n = qweight.shape[1]
    group = k // scales.shape[0]
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    if group % 8:  # a group boundary inside a packed word: no per-word scales; dequantize instead
        return torch.nn.functional.linear(x, int4_dequantize(qweight, scales, zeros).to(x.dtype).t(), bias)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 activations: no TF32 rounding
    args = (x, qweight, scales, zeros)
    c = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws, counts = split_workspace(x.device, m, n)
    bias_arg = bias if bias is not None else c
    if split_k is None and blocks is None and _autotune():
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]),  # noqa: E731
                             meta["SPLIT_K"])
        _int4_gemm_tuned[grid](*args, c, ws, counts, bias_arg, m, n, k, m_bucket(m),
                               x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), c.stride(0),
                               GROUP=group, HAS_BIAS=bias is not None, ATOMIC=True, UPCAST=False, PRECISION=precision)
        return c
    block_m, block_n, block_k, split, warps, stages = _fixed_config(m, n, k, x.device)
    if blocks is not None:
        block_m, block_n, block_k = blocks
    split = split if split_k is None else split_k
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    _int4_gemm_kernel[grid](*args, c, ws, counts, bias_arg, m, n, k, m_bucket(m),
                            x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), c.stride(0), split,
                            GROUP=group, HAS_BIAS=bias is not None, ATOMIC=split > 1, UPCAST=interpreting(),
                            PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                            num_warps=warps, num_stages=stages)
    return c


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    block_k: int = 128) -> torch.Tensor:
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    group = k // scales.shape[0]
    out = torch.empty((k, n), dtype=scales.dtype, device=qweight.device)
    if group % 8:  # the kernel shares one group per packed word
        from pagoda_quant.formats.int4 import dequantize_packed

        return dequantize_packed(qweight, scales, zeros)
    block_n = 128
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _int4_dequant_kernel[grid](qweight, scales, zeros, out, k, n, qweight.stride(0), scales.stride(0),
                               zeros.stride(0), out.stride(0), GROUP=group, INTERPRET=interpreting(),
                               BLOCK_K=block_k, BLOCK_N=block_n, num_warps=4)
    return out
