"""One tile of paged keys folded into a running softmax: the inner step of the prefill and
decode attention kernels (``prefill.py``, ``decode.py``).

``key_tile`` gathers BLOCK_N keys and values through the block table (a page index per key),
scores them against the query rows, masks what a row may not see (MASKED: keys past ``hi``,
after the row's position ``qpos``, outside its window) and updates (acc, m_i, l_i) in the
exp2 domain. Tiles that every row sees whole skip the masking (MASKED=False). With a window,
keys that no row of the tile sees are not loaded at all: their blocks may have been freed and
reused (``BlockManager`` releases blocks that left every window), and a masked score times a
non-finite stale value would still poison the sum.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagoda_cuda._triton import mma, tanh


@triton.jit
def key_tile(acc, m_i, l_i, q, qr, n0, hi, qpos, window, table_row, stride_tn, k_base, v_base, stride_cb,
             stride_cs, stride_vb, stride_vs, kr_cache, stride_rb, stride_rs, d, dmask, dv, dvmask, r, rmask, scale,
             soft_cap, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, MASKED: tl.constexpr,
             USE_WINDOW: tl.constexpr, USE_CAP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
             ROPE: tl.constexpr):
    """Keys n0 .. n0 + BLOCK_N folded into the running softmax (acc, m_i, l_i). MASKED=False:
    every query row sees every key of the tile (no mask; each row's maximum is finite after it).
    ROPE: the scores add qr . kr, the rotary parts of MLA's queries and keys kept in their own
    tensors (a second, exactly sized dot instead of one over a concatenation padded to 256)."""
    n = n0 + tl.arange(0, BLOCK_N)
    in_page = (n % PAGE).to(tl.int64)
    if MASKED:
        nmask = n < hi
        page = tl.load(table_row + (n // PAGE) * stride_tn, mask=nmask, other=0).to(tl.int64)
        if USE_WINDOW:  # keys before the first row's window are seen by no row
            nmask = nmask & (n > tl.min(qpos, axis=0) - window)
        kmask = nmask[:, None] & dmask[None, :]
        vmask = nmask[:, None] & dvmask[None, :]
    else:
        page = tl.load(table_row + (n // PAGE) * stride_tn).to(tl.int64)
        kmask = dmask[None, :]
        vmask = dvmask[None, :]
    k = tl.load(k_base + (page * stride_cb + in_page * stride_cs)[:, None] + d[None, :], mask=kmask, other=0.0)
    v = tl.load(v_base + (page * stride_vb + in_page * stride_vs)[:, None] + dv[None, :], mask=vmask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = mma(q, tl.trans(k), UPCAST, IEEE)
    if ROPE:
        kr_rows = page * stride_rb + in_page * stride_rs
        if MASKED:
            kr = tl.load(kr_cache + kr_rows[:, None] + r[None, :], mask=nmask[:, None] & rmask[None, :], other=0.0)
        else:
            kr = tl.load(kr_cache + kr_rows[:, None] + r[None, :], mask=rmask[None, :], other=0.0)
        s += mma(qr, tl.trans(kr.to(qr.dtype)), UPCAST, IEEE)
    if USE_CAP:
        s = soft_cap * tanh(s * scale / soft_cap) * 1.4426950408889634
    else:
        s = s * (scale * 1.4426950408889634)
    if MASKED:
        allowed = nmask[None, :] & (n[None, :] <= qpos[:, None])
        if USE_WINDOW:
            allowed = allowed & (n[None, :] > qpos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = m_new
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pv = mma(p, v, UPCAST, IEEE)
    return acc * alpha[:, None] + pv, m_new, l_i
