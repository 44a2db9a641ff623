"""Rotary embedding of q and k in one launch, one program per token (optionally after an
RMSNorm of every head: Qwen3's q/k norms, fused so that a layer launches one kernel, not three).

Works for any ``cos_sin_cache`` the core builds (every scaling folds into the table) and
both layouts: neox (rotate halves) and interleaved (rotate even/odd pairs). Dims past
``rotary_dim`` are copied unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_cuda._triton import next_pow2, pdl, wait_for_inputs


@triton.jit
def _halves(ptr, offset, rows, hmask, ROT: tl.constexpr, HALF_PAD: tl.constexpr, ROWS_PAD: tl.constexpr,
            IS_NEOX: tl.constexpr):
    """The two halves of every rotated pair of ``rows`` (row r at ptr + offset + rows[r]):
    [ROWS_PAD, HALF_PAD] each. Interleaved pairs are read as whole contiguous rows and split
    in registers (two stride-2 reads ran at about 6% of the bandwidth of this on an H200)."""
    if IS_NEOX:
        i = tl.arange(0, HALF_PAD)
        mask = hmask[:, None] & (i[None, :] < ROT // 2)
        x1 = tl.load(ptr + offset + rows[:, None] + i[None, :], mask=mask, other=0.0)
        x2 = tl.load(ptr + offset + rows[:, None] + ROT // 2 + i[None, :], mask=mask, other=0.0)
    else:
        c = tl.arange(0, 2 * HALF_PAD)
        mask = hmask[:, None] & (c[None, :] < ROT)
        pairs = tl.load(ptr + offset + rows[:, None] + c[None, :], mask=mask, other=0.0)
        x1, x2 = tl.split(tl.reshape(pairs, [ROWS_PAD, HALF_PAD, 2]))
    return x1, x2


@triton.jit
def _store_halves(ptr, offset, rows, hmask, o1, o2, ROT: tl.constexpr, HALF_PAD: tl.constexpr,
                  ROWS_PAD: tl.constexpr, IS_NEOX: tl.constexpr):
    if IS_NEOX:
        i = tl.arange(0, HALF_PAD)
        mask = hmask[:, None] & (i[None, :] < ROT // 2)
        tl.store(ptr + offset + rows[:, None] + i[None, :], o1, mask=mask)
        tl.store(ptr + offset + rows[:, None] + ROT // 2 + i[None, :], o2, mask=mask)
    else:
        c = tl.arange(0, 2 * HALF_PAD)
        mask = hmask[:, None] & (c[None, :] < ROT)
        tl.store(ptr + offset + rows[:, None] + c[None, :], tl.reshape(tl.join(o1, o2), [ROWS_PAD, 2 * HALF_PAD]),
                 mask=mask)


@triton.jit
def _rotate_heads(x_ptr, x_row, o_ptr, o_row, num_heads, cos, sin, w_ptr, eps,
                  HEAD: tl.constexpr, ROT: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
                  PASS_PAD: tl.constexpr, IS_NEOX: tl.constexpr, NORM: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)
    hmask = heads < num_heads
    base = heads * HEAD
    x1, x2 = _halves(x_ptr, x_row, base, hmask, ROT, HALF_PAD, HEADS_PAD, IS_NEOX)
    j = ROT + tl.arange(0, PASS_PAD)
    pmask = hmask[:, None] & (j[None, :] < HEAD)
    if ROT < HEAD:  # pass-through dims
        rest = tl.load(x_ptr + x_row + base[:, None] + j[None, :], mask=pmask, other=0.0)
    if NORM:  # RMSNorm of each head first, rounded as pagoda.kernels.reference.rms_norm rounds
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        ss = tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)
        if ROT < HEAD:
            fr = rest.to(tl.float32)
            ss += tl.sum(fr * fr, axis=1)
        inv = (1.0 / tl.sqrt(ss / HEAD + eps))[:, None]
        one = tl.zeros([1], dtype=tl.int32)
        w1, w2 = _halves(w_ptr, 0, one, one == 0, ROT, HALF_PAD, 1, IS_NEOX)
        x1 = ((f1 * inv).to(x_ptr.dtype.element_ty).to(tl.float32) * w1.to(tl.float32)).to(o_ptr.dtype.element_ty)
        x2 = ((f2 * inv).to(x_ptr.dtype.element_ty).to(tl.float32) * w2.to(tl.float32)).to(o_ptr.dtype.element_ty)
        if ROT < HEAD:
            wr = tl.load(w_ptr + j, mask=j < HEAD, other=0.0).to(tl.float32)[None, :]
            rest = ((fr * inv).to(x_ptr.dtype.element_ty).to(tl.float32) * wr).to(o_ptr.dtype.element_ty)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    o1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(o_ptr.dtype.element_ty)
    o2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(o_ptr.dtype.element_ty)
    _store_halves(o_ptr, o_row, base, hmask, o1, o2, ROT, HALF_PAD, HEADS_PAD, IS_NEOX)
    if ROT < HEAD:
        tl.store(o_ptr + o_row + base[:, None] + j[None, :], rest, mask=pmask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, q_stride, k_ptr, k_stride, qo_ptr, ko_ptr, cache_ptr, cache_stride,
                   num_q_heads, num_k_heads, qw_ptr, kw_ptr, eps,
                   HEAD: tl.constexpr, ROT: tl.constexpr, HALF_PAD: tl.constexpr, QH_PAD: tl.constexpr,
                   KH_PAD: tl.constexpr, PASS_PAD: tl.constexpr, IS_NEOX: tl.constexpr, NORM: tl.constexpr,
                   PDL: tl.constexpr):
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    cmask = i < ROT // 2
    cos = tl.load(cache_ptr + pos * cache_stride + i, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * cache_stride + ROT // 2 + i, mask=cmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, t * q_stride, qo_ptr, t * num_q_heads * HEAD, num_q_heads, cos, sin, qw_ptr, eps,
                  HEAD, ROT, HALF_PAD, QH_PAD, PASS_PAD, IS_NEOX, NORM)
    _rotate_heads(k_ptr, t * k_stride, ko_ptr, t * num_k_heads * HEAD, num_k_heads, cos, sin, kw_ptr, eps,
                  HEAD, ROT, HALF_PAD, KH_PAD, PASS_PAD, IS_NEOX, NORM)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(positions, q, k, head_size, cos_sin_cache, is_neox, norm=None):
    t = q.shape[0]
    q2, k2 = _rows(q.reshape(t, -1)), _rows(k.reshape(t, -1))
    nq, nk = q2.shape[1] // head_size, k2.shape[1] // head_size
    rot = cos_sin_cache.shape[-1]
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    out_dtype = q.dtype if norm is None else torch.promote_types(norm[0].dtype, q.dtype)
    q_out = torch.empty((t, nq * head_size), dtype=out_dtype, device=q.device)
    k_out = torch.empty((t, nk * head_size), dtype=out_dtype, device=k.device)
    if t == 0:
        return q_out.view(t, -1), k_out.view(t, -1)
    pos = positions if positions.is_contiguous() else positions.contiguous()
    q_weight, k_weight, eps = norm if norm is not None else (cache, cache, 0.0)
    work = max(nq, nk) * next_pow2(head_size)
    early = pdl(q.device)
    _rotary_kernel[(t,)](pos, q2, q2.stride(0), k2, k2.stride(0), q_out, k_out, cache, cache.stride(0),
                         nq, nk, q_weight, k_weight, float(eps), HEAD=head_size, ROT=rot,
                         HALF_PAD=next_pow2(rot // 2), QH_PAD=next_pow2(nq), KH_PAD=next_pow2(nk),
                         PASS_PAD=next_pow2(max(1, head_size - rot)), IS_NEOX=is_neox, NORM=norm is not None,
                         PDL=early, num_warps=4 if work <= 4096 else 8, launch_pdl=early)
    return q_out, k_out


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, nq*hs], k [T, nk*hs] -> rotated copies (same shapes, contiguous)."""
    q_out, k_out = _launch(positions, q, k, head_size, cos_sin_cache, is_neox)
    return q_out.view(q.shape), k_out.view(k.shape)


def qk_norm_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, eps: float, head_size: int, cos_sin_cache: torch.Tensor,
                   is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of every head of q and k, then the rotary embedding, in one launch (Qwen3's
    q_norm/k_norm): q [T, nq*hs], k [T, nk*hs] (views into a fused projection) -> [T, n*hs]."""
    return _launch(positions, q, k, head_size, cos_sin_cache, is_neox, (q_weight, k_weight, eps))
