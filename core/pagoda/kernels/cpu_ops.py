"""The CPU platform's own float32 ``rms_norm``, ``fused_add_rms_norm``, ``rotary_embedding``,
``silu_and_mul`` and ``store_kv_cache``, and decode attention over the paged cache (``cpu_sdpa``'s).

A decode step on a small model is mostly small ops: the torch reference of these three takes 6-15 torch
calls each (casts, reductions, index_select, slices, cat), tens of microseconds per layer for a single
token row, which on SmolLM2 added up to a fifth of the step. ``cpu_ops.c`` does each in one C call (built by
``pagoda.kernels.native``; results equal the reference's up to float32 rounding). Anything else
(another dtype, a row layout the C code does not take, no compiler) goes to ``pagoda.kernels.reference``.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pagoda.kernels import reference

SOURCE = Path(__file__).with_name("cpu_ops.c")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@functools.lru_cache(maxsize=1)
def _lib():
    from pagoda.kernels.native import load

    lib = load(SOURCE)
    if lib is None:
        return None
    lib.pagoda_rms_norm.argtypes = [_P, _I, _I, _I, _P, _F, _P]
    lib.pagoda_add_rms_norm.argtypes = [_P, _P, _I, _I, _P, _F, _P, _P]
    lib.pagoda_rotary.argtypes = [_P, _I, _I, _I, _I, _P, _P, _I, _I, ctypes.c_int, _P]
    lib.pagoda_rotary.restype = _I
    for fn in (lib.pagoda_rms_norm, lib.pagoda_add_rms_norm):
        fn.restype = None
    lib.pagoda_store_kv.argtypes = [_P, _P, _I, _I, _I, _I, _P, _P, _P, _I]
    lib.pagoda_store_kv.restype = _I
    lib.pagoda_decode_attention.argtypes = [_P, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _P, _I, _F, _P,
                                            ctypes.c_int]
    lib.pagoda_decode_attention.restype = ctypes.c_int
    lib.pagoda_silu_and_mul.argtypes = [_P, _I, _I, _I, _P]
    lib.pagoda_silu_and_mul.restype = None
    return lib


def available() -> bool:
    return _lib() is not None


F32 = torch.float32


def _rows(x: torch.Tensor) -> bool:
    """A float32 tensor [T, H] whose rows are contiguous (any row stride). These ops are registered for
    the CPU platform only: the device is not checked (a call costs a few microseconds; checks count)."""
    return x.dtype is F32 and x.dim() == 2 and x.stride(1) == 1


def _weight(w: torch.Tensor) -> bool:
    return w.dtype is F32 and w.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    lib = _lib()
    if lib is None or not _rows(x) or not _weight(weight):
        return reference.rms_norm(x, weight, eps)
    t, h = x.shape
    out = torch.empty(t, h, dtype=F32)
    lib.pagoda_rms_norm(x.data_ptr(), t, h, x.stride(0), weight.data_ptr(), eps, out.data_ptr())
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    lib = _lib()
    if (lib is None or not (_rows(x) and x.is_contiguous() and _rows(residual) and residual.is_contiguous())
            or x.shape != residual.shape or not _weight(weight)):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    t, h = x.shape
    out, summed = torch.empty(t, h, dtype=F32), torch.empty(t, h, dtype=F32)
    lib.pagoda_add_rms_norm(x.data_ptr(), residual.data_ptr(), t, h, weight.data_ptr(), eps, out.data_ptr(),
                            summed.data_ptr())
    return out, summed


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    lib = _lib()
    rot = cos_sin_cache.shape[-1]
    if (lib is None or not (_rows(q) and _rows(k)) or not _weight(cos_sin_cache) or q.shape[1] % head_size
            or k.shape[1] % head_size or rot > head_size or rot % 2 or positions.dtype is not torch.int64
            or not positions.is_contiguous() or positions.numel() < max(q.shape[0], k.shape[0])):
        return reference.rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox)
    npos = cos_sin_cache.shape[0]
    outs = []
    for x in (q, k):
        t, width = x.shape
        out = torch.empty(t, width, dtype=F32)
        # the C code checks every position against the table first (no torch reduction and sync per layer)
        bad = lib.pagoda_rotary(x.data_ptr(), t, width // head_size, head_size, x.stride(0), positions.data_ptr(),
                                cos_sin_cache.data_ptr(), npos, rot, int(bool(is_neox)), out.data_ptr())
        if bad >= 0:  # the reference's IndexError, never a read outside the table
            raise IndexError(f"rotary_embedding: position {int(positions[bad])} is outside the cos/sin cache's "
                             f"{npos} rows")
        outs.append(out)
    return outs[0], outs[1]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    lib = _lib()
    if lib is None or not _rows(x) or x.shape[1] % 2:
        return reference.silu_and_mul(x)
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, n, dtype=F32)
    lib.pagoda_silu_and_mul(x.data_ptr(), t, n, x.stride(0), out.data_ptr())
    return out


def _heads(x: torch.Tensor) -> bool:
    """A float32 [T, heads, hs] whose rows are contiguous (any row stride)."""
    return x.dtype is F32 and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    lib = _lib()
    if (lib is None or k_scale is not None or kv_cache.dtype is not F32 or not kv_cache.is_contiguous()
            or not (_heads(k) and _heads(v)) or k.shape != v.shape or slot_mapping.dtype is not torch.int64
            or not slot_mapping.is_contiguous() or k.shape[0] > slot_mapping.shape[0]):
        return reference.store_kv_cache(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    t, nk, hs = k.shape
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[-2] != nk or kv_cache.shape[-1] != hs:
        return reference.store_kv_cache(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    total = kv_cache.shape[1] * kv_cache.shape[2]
    base, half = kv_cache.data_ptr(), total * nk * hs * 4
    bad = lib.pagoda_store_kv(k.data_ptr(), v.data_ptr(), t, nk * hs, k.stride(0), v.stride(0),
                              slot_mapping.data_ptr(), base, base + half, total)
    if bad >= 0:
        raise IndexError(f"store_kv_cache: slot {int(slot_mapping[bad])} is past the cache's {total} slots")


def decode_attention_supported(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether ``decode_attention`` takes these: float32 rows and a contiguous float32 cache
    [2, blocks, block_size, kv_heads, head_size], with the C library built."""
    return (_lib() is not None and q.dtype is F32 and kv_cache.dtype is F32 and kv_cache.dim() == 5
            and kv_cache.shape[0] == 2 and kv_cache.is_contiguous() and q.stride(2) == 1
            and q.stride(1) == q.shape[2])


def decode_attention(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, window: int | None, scale: float) -> None:
    """One query token per sequence against its cached keys, read through the block table (no gather):
    q [B, nq, d] (rows may be strided), tables int64 [B, max_blocks], lens int64 [B] -> out [B, nq, d]
    (contiguous float32). ``decode_attention_supported`` says when this applies."""
    nb, nq, d = q.shape
    blocks, bs, nk = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[3]
    base = kv_cache.data_ptr()
    rc = _lib().pagoda_decode_attention(q.data_ptr(), nb, nq, d, q.stride(0), base, base + blocks * bs * nk * d * 4,
                                        nk, bs, tables.data_ptr(), tables.stride(0), lens.data_ptr(), window or 0,
                                        scale, out.data_ptr(), torch.get_num_threads())
    if rc:
        raise MemoryError("decode attention: no memory for the scores")
