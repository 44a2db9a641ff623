"""Fused mixture-of-experts: (token, expert) pairs grouped by expert, one grouped GEMM launch
per projection, routing weights applied, the top-k results summed.

1. ``align``: on the device (no host sync, so graph-capturable), sort the T*K pairs by expert
   and pad each expert's run to a multiple of BLOCK_M; every BLOCK_M block of the sorted list
   belongs to one expert (``block_expert``; E for blocks past the end).
2. gate/up: one launch; each program multiplies BLOCK_M gathered token rows by BLOCK_N rows of
   the expert's gate and up weights and writes ``act(gate) * up`` [padded rows, I]. Programs
   run in groups of GROUP_M row blocks that sweep every column tile before the next group
   starts (``_tile``), so a row block's gathered activations and an expert's weights are
   reused from L2 while they are hot instead of being read from memory once per column tile.
3. down: one launch; the same blocks times the expert's down weight, scaled by each pair's
   routing weight, written per pair [T*K, H].
4. combine: per token, the sum over its K pairs (ids outside [0, E) contribute nothing).

Rounding follows ``pagoda.kernels.reference.fused_moe``: each GEMM result is rounded to the
activation dtype, as are the activation and the weighted product; the top-k sum is in float32.
Expert biases (GPT-OSS) are added to the rounded GEMM results and rounded again, as the
reference's ``x @ w.t() + b`` does; ``swigluoai`` is GPT-OSS's clamped SwiGLU.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
import triton
import triton.language as tl
from pagoda.layers.moe_grouping import group_pairs_by_expert

from pagoda_cuda._triton import gelu_tanh, interpreting, next_pow2, silu

logger = logging.getLogger("pagoda")


@triton.jit
def _tile(num_m, num_n, GROUP_M: tl.constexpr):
    """(row block, column tile) of this program in the grouped order: GROUP_M row blocks
    take every column tile in turn (the last group may be shorter)."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(num_m - first_m, GROUP_M)
    within = pid % per_group
    return first_m + within % rows_here, within // rows_here


@triton.jit
def _gate_up_kernel(h_ptr, stride_ht, w_ptr, stride_we, stride_wn, out_ptr, stride_ot, pairs_ptr,
                    block_expert_ptr, num_pairs, num_experts, H, inner, num_m, bias_ptr, stride_be,
                    TOPK: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                    W_DESC: tl.constexpr):
    pid_m, pid_n = _tile(num_m, tl.cdiv(inner, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    rmask = pair < num_pairs
    token = (pair // TOPK).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < inner
    if not W_DESC:
        w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < H
        a = tl.load(h_ptr + token[:, None] * stride_ht + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        if W_DESC:  # w_ptr: a descriptor over [E * 2I, H]; rows past a run are masked at the store
            row = expert * 2 * inner + pid_n * BLOCK_N
            wg = tl.trans(w_ptr.load([row, k0]))
            wu = tl.trans(w_ptr.load([row + inner, k0]))
        else:
            wmask = kmask[:, None] & nmask[None, :]
            wg = tl.load(w_base + n[None, :].to(tl.int64) * stride_wn + k[:, None], mask=wmask, other=0.0)
            wu = tl.load(w_base + (inner + n)[None, :].to(tl.int64) * stride_wn + k[:, None], mask=wmask,
                         other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        if IEEE:  # float32 models: no TF32 rounding
            acc_gate += tl.dot(a, wg, input_precision="ieee")
            acc_up += tl.dot(a, wu, input_precision="ieee")
        else:
            acc_gate += tl.dot(a, wg)
            acc_up += tl.dot(a, wu)
    dtype = out_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    if HAS_BIAS:
        b_base = bias_ptr + expert.to(tl.int64) * stride_be
        gate = (gate + tl.load(b_base + n, mask=nmask, other=0.0).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
        up = (up + tl.load(b_base + inner + n, mask=nmask, other=0.0).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
    if ACT == "silu":
        act = silu(gate)
    elif ACT == "swigluoai":  # GPT-OSS: gate clamped above at 7, up to [-7, 7], (up + 1) * gate * sigmoid(1.702 gate),
        # rounded after each step as the reference's (and transformers') dtype ops are
        gate = tl.minimum(gate, 7.0)
        up = (tl.minimum(tl.maximum(up, -7.0), 7.0) + 1.0).to(dtype).to(tl.float32)
        z = (1.702 * gate).to(dtype).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-z))).to(dtype).to(tl.float32)
        act = gate * sig
    else:
        act = gelu_tanh(gate)
    act = act.to(dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + n[None, :], (act * up).to(dtype),
             mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _down_kernel(x_ptr, stride_xt, w_ptr, stride_we, stride_wn, out_ptr, stride_ot, pairs_ptr, block_expert_ptr,
                 weights_ptr, num_pairs, num_experts, H, inner, num_m, bias_ptr, stride_be,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr,
                 UPCAST: tl.constexpr, IEEE: tl.constexpr, W_DESC: tl.constexpr):
    pid_m, pid_n = _tile(num_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    rmask = pair < num_pairs
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    if not W_DESC:
        w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inner, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < inner
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xt + k[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        if W_DESC:  # w_ptr: a descriptor over [E * H, I]
            w = tl.trans(w_ptr.load([expert * H + pid_n * BLOCK_N, k0]))
        else:
            w = tl.load(w_base + n[None, :].to(tl.int64) * stride_wn + k[:, None],
                        mask=kmask[:, None] & nmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    dtype = out_ptr.dtype.element_ty
    route = tl.load(weights_ptr + pair, mask=rmask, other=0.0).to(dtype).to(tl.float32)
    y = acc.to(dtype).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + n, mask=nmask, other=0.0).to(tl.float32)
        y = (y + bias[None, :]).to(dtype).to(tl.float32)
    y = y * route[:, None]
    tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_ot + n[None, :], y.to(dtype),
             mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _combine_kernel(pairs_out_ptr, ids_ptr, out_ptr, H, num_experts, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(TOPK):
        e = tl.load(ids_ptr + t * TOPK + j)
        valid = (e >= 0) & (e < num_experts)
        acc += tl.load(pairs_out_ptr + (t * TOPK + j) * H + cols, mask=cmask & valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


# the one-launch Triton grouping serves up to this many pairs (decode and small prefills); the
# torch ops sort larger batches. It is dropped for the process if it ever fails to build.
TRITON_ALIGN_MAX_PAIRS = 16384
_triton_align_ok = True


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``pagoda.layers.moe_grouping.group_pairs_by_expert``'s contract: one Triton launch up to
    TRITON_ALIGN_MAX_PAIRS pairs, the core's torch ops beyond."""
    global _triton_align_ok
    if _triton_align_ok and topk_ids.numel() <= TRITON_ALIGN_MAX_PAIRS:
        try:
            from pagoda_cuda.ops.moe_align import align_triton

            return align_triton(topk_ids, num_experts, block_m)
        except Exception as exc:  # a Triton build problem here: the core's torch ops do the same
            if topk_ids.is_cuda and torch.cuda.is_current_stream_capturing():
                raise
            _triton_align_ok = False
            logger.warning("fused_moe: the Triton grouping kernel failed (%s: %s); using torch ops",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    return group_pairs_by_expert(topk_ids, num_experts, block_m)


CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
_TUNED: dict[str, dict] = {}


def shape_key(num_experts: int, hidden: int, inner: int) -> str:
    return f"E{num_experts}_H{hidden}_I{inner}"


def tuned_table(device: torch.device) -> dict:
    """Tile configs measured on this GPU model by ``python -m pagoda_cuda.kernel_bench --tune-moe``:
    configs/fused_moe_<gpu name>.json = {"shapes": {shape_key: [[pairs per expert, config], ...]}}."""
    if device.type != "cuda":
        return {}
    name = torch.cuda.get_device_name(device)
    if name not in _TUNED:
        path = CONFIG_DIR / f"fused_moe_{re.sub(r'[^A-Za-z0-9]+', '_', name)}.json"
        _TUNED[name] = json.loads(path.read_text()).get("shapes", {}) if path.is_file() else {}
    return _TUNED[name]


def default_group_m(per_expert: float) -> int:
    """GROUP_M for entries that do not name one. Measured on an H200 (kernel_bench): at decode
    loads (about 16 pairs per expert) the grouping changes nothing (within 1%); at an
    8,192-token prefill step it is 4-7% faster than the plain order with 4 or 8 row blocks
    per group, and slower with 16."""
    return 1 if per_expert <= 48 else 4


def moe_config(num_pairs: int, num_experts: int, hidden: int = 0, inner: int = 0,
               device: torch.device | None = None,
               dtype: torch.dtype = torch.bfloat16) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M[, weight descriptors]): a tuned entry for this
    shape and GPU when there is one (the first measured load at or above this one), else by
    the mean pairs per expert. float32 (exact IEEE products, a check mode) takes small tiles:
    the tuned 16-bit tiles as IEEE float32 products take minutes to compile and overflow
    shared memory."""
    per_expert = num_pairs / max(1, num_experts)
    group = default_group_m(per_expert)
    if dtype == torch.float32:
        return (16 if per_expert <= 16 else 32), 64, 32, 4, 2, group
    entries = tuned_table(device).get(shape_key(num_experts, hidden, inner)) if device is not None else None
    if entries:
        ordered = sorted(entries)
        chosen = next((config for load, config in ordered if per_expert <= load), ordered[-1][1])
        return with_group(chosen, group)
    if per_expert <= 16:
        return 16, 64, 128, 4, 4, group
    if per_expert <= 48:
        return 32, 64, 128, 4, 4, group
    if per_expert <= 160:
        return 64, 64, 64, 4, 4, group
    return 64, 128, 64, 8, 3, group


def with_group(config, group: int) -> tuple[int, ...]:
    """A 5-entry config (tables and sweeps from before GROUP_M) completed with ``group``; a 7th
    entry (weight tiles through descriptors, 0/1) is kept."""
    config = tuple(int(v) for v in config)
    return config if len(config) >= 6 else config[:5] + (group,)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu",
              config: tuple[int, ...] | None = None, weight_tma: bool | None = None,
              w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, K]; topk_ids [T, K] -> [T, H];
    optional expert biases w13_bias [E, 2I] and w2_bias [E, H].
    ``config`` overrides ``moe_config`` (tuning sweeps; GROUP_M may be left out; a 7th entry
    says whether weight tiles load through descriptors); ``weight_tma`` overrides both."""
    if activation not in ("silu", "gelu_tanh", "swigluoai"):
        raise ValueError(f"fused_moe: activation {activation!r} is not supported (silu, gelu_tanh, swigluoai)")
    t, h = hidden.shape
    num_experts, two_inner, _ = w13.shape
    inner = two_inner // 2
    topk = topk_ids.shape[1]
    out = torch.empty((t, h), dtype=hidden.dtype, device=hidden.device)
    if t == 0:
        return out
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    w13 = w13 if w13.is_contiguous() else w13.contiguous()
    w2 = w2 if w2.is_contiguous() else w2.contiguous()
    num_pairs = t * topk
    chosen = (with_group(config, default_group_m(num_pairs / num_experts)) if config else
              moe_config(num_pairs, num_experts, h, inner, hidden.device, hidden.dtype))
    block_m, block_n, block_k, num_warps, num_stages, group_m = chosen[:6]
    if weight_tma is None:  # weight tiles through TMA descriptors (Hopper and later) when the entry says so
        weight_tma = len(chosen) > 6 and bool(chosen[6])
    block_k = min(block_k, max(16, next_pow2(min(h, inner))))
    pairs, block_expert, max_blocks = align(topk_ids, num_experts, block_m)
    upcast = interpreting()
    ieee = hidden.dtype == torch.float32
    act = torch.empty((max_blocks * block_m, inner), dtype=hidden.dtype, device=hidden.device)
    w13_arg, w2_arg = w13, w2
    if weight_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        w13_arg = TensorDescriptor.from_tensor(w13.view(num_experts * two_inner, h), [block_n, block_k])
        w2_arg = TensorDescriptor.from_tensor(w2.view(num_experts * h, inner), [block_n, block_k])
    _gate_up_kernel[(max_blocks * triton.cdiv(inner, block_n),)](
        hidden, hidden.stride(0), w13_arg, w13.stride(0), w13.stride(1), act, act.stride(0), pairs, block_expert,
        num_pairs, num_experts, h, inner, max_blocks, w13_bias if w13_bias is not None else w13,
        w13_bias.stride(0) if w13_bias is not None else 0, HAS_BIAS=w13_bias is not None,
        TOPK=topk, ACT={"silu": "silu", "swigluoai": "swigluoai"}.get(activation, "gelu"),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, UPCAST=upcast, IEEE=ieee,
        W_DESC=weight_tma, num_warps=num_warps, num_stages=num_stages)
    per_pair = torch.empty((num_pairs, h), dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _down_kernel[(max_blocks * triton.cdiv(h, block_n),)](
        act, act.stride(0), w2_arg, w2.stride(0), w2.stride(1), per_pair, per_pair.stride(0), pairs, block_expert,
        weights, num_pairs, num_experts, h, inner, max_blocks, w2_bias if w2_bias is not None else w2,
        w2_bias.stride(0) if w2_bias is not None else 0, HAS_BIAS=w2_bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=group_m, UPCAST=upcast, IEEE=ieee, W_DESC=weight_tma, num_warps=num_warps, num_stages=num_stages)
    ids = topk_ids.reshape(-1).contiguous()
    _combine_kernel[(t, triton.cdiv(h, 1024))](per_pair, ids, out, h, num_experts, TOPK=topk, BLOCK=1024,
                                               num_warps=4)
    return out
