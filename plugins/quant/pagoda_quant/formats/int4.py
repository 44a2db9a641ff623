"""4-bit integer weights: group-wise round-to-nearest quantization and the packed layouts.

A weight W [N, K] (N outputs, K inputs) is split into groups of ``group_size`` consecutive
input columns; each (output row, group) has a scale s and a zero point z (0..15) and
``W[n, k] ≈ (q[n, k] - z[n, g]) * s[n, g]`` with q in 0..15 and g = k // group_size.
Symmetric quantization fixes z = 8 (GPTQ's convention for ``sym: true``).

Packed layouts (int32 words holding eight 4-bit values, nibble i at bits 4i..4i+3):
  * pagoda's kernel layout — the GPTQ layout without the zero-point offset:
      qweight [K/8, N]  packed along K, nibble i of row r = input row 8r+i
      scales  [K/G, N]  in the activation dtype
      zeros   [K/G, N]  unpacked, in the activation dtype (integers 0..15)
  * GPTQ checkpoints:  qweight [K/8, N] as above; qzeros [K/G, N/8] packed along N
      (nibble i = output column 8c+i) storing ``z - 1`` in the original format
      (``checkpoint_format: gptq``) and ``z`` in ``gptq_v2``; scales [K/G, N]; g_idx [K].
  * AWQ checkpoints (GEMM version): qweight [K, N/8] and qzeros [K/G, N/8] packed along N
      in AWQ's interleaved order — nibble i holds output column 8c + AWQ_ORDER[i] —
      storing z itself; scales [K/G, N].
"""

from __future__ import annotations

import torch

PACK = 8  # 4-bit values per int32
MAXQ = 15
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its group of 8
SHIFTS = tuple(4 * i for i in range(PACK))


def quantize_groups(w: torch.Tensor, group_size: int, symmetric: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest: w [N, K] -> (q uint8 [N, K] in 0..15, scales f32 [N, K/G], zeros f32 [N, K/G]).

    ``group_size`` -1 means one group over the whole row. K must be a multiple of the group size.
    """
    n, k = w.shape
    g = k if group_size in (-1, 0, None) else group_size
    if k % g:
        raise ValueError(f"input size {k} is not a multiple of group_size {g}")
    groups = w.float().reshape(n, k // g, g)
    if symmetric:
        amax = groups.abs().amax(dim=-1)
        scales = (2 * amax / MAXQ).clamp_(min=1e-10)
        zeros = torch.full_like(scales, 8.0)
    else:
        lo = groups.amin(dim=-1).clamp(max=0.0)
        hi = groups.amax(dim=-1).clamp(min=0.0)
        scales = ((hi - lo) / MAXQ).clamp_(min=1e-10)
        zeros = torch.round(-lo / scales).clamp_(0, MAXQ)
    q = torch.round(groups / scales[..., None] + zeros[..., None]).clamp_(0, MAXQ)
    return q.reshape(n, k).to(torch.uint8), scales, zeros


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """(q [N, K], scales [N, K/G], zeros [N, K/G]) -> float32 [N, K]."""
    n, k = q.shape
    g = k // scales.shape[-1]
    groups = q.float().reshape(n, -1, g)
    return ((groups - zeros.float()[..., None]) * scales.float()[..., None]).reshape(n, k)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) -> int32 with the same bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """q [R, C] (values 0..15) -> int32 [R/8, C], nibble i of word r = q[8r + i]."""
    r, c = q.shape
    parts = q.to(torch.int64).reshape(r // PACK, PACK, c)
    words = torch.zeros(r // PACK, c, dtype=torch.int64, device=q.device)
    for i in range(PACK):
        words |= parts[:, i] << SHIFTS[i]
    return _to_int32(words)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R/8, C] -> uint8 [R, C] (inverse of ``pack_rows``)."""
    shifts = torch.tensor(SHIFTS, dtype=torch.int32, device=packed.device).view(1, PACK, 1)
    return ((packed.unsqueeze(1) >> shifts) & 0xF).reshape(-1, packed.shape[-1]).to(torch.uint8)


def pack_cols(q: torch.Tensor, order: tuple[int, ...] = tuple(range(PACK))) -> torch.Tensor:
    """q [R, C] -> int32 [R, C/8]; nibble i of word c holds column 8c + order[i]."""
    r, c = q.shape
    parts = q.to(torch.int64).reshape(r, c // PACK, PACK)
    words = torch.zeros(r, c // PACK, dtype=torch.int64, device=q.device)
    for i in range(PACK):
        words |= parts[..., order[i]] << SHIFTS[i]
    return _to_int32(words)


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(PACK))) -> torch.Tensor:
    """int32 [R, C/8] -> uint8 [R, C] (inverse of ``pack_cols`` with the same order)."""
    shifts = torch.tensor(SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C/8, 8], nibble i
    columns = torch.empty_like(nibbles)
    columns[..., list(order)] = nibbles  # column order[i] <- nibble i
    return columns.reshape(packed.shape[0], -1).to(torch.uint8)


def dequantize_packed(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
    """pagoda's kernel layout -> W^T [K, N] in ``dtype`` (default: the scales' dtype)."""
    q = unpack_rows(qweight)  # [K, N]
    k = q.shape[0]
    g = k // scales.shape[0]
    idx = torch.arange(k, device=q.device) // g
    w = (q.float() - zeros.float()[idx]) * scales.float()[idx]
    return w.to(dtype or scales.dtype)


def to_kernel_layout(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From ``quantize_groups``' [N, K] outputs to (qweight [K/8, N], scales [K/G, N], zeros [K/G, N])."""
    return (pack_rows(q.t().contiguous()), scales.t().contiguous().to(dtype),
            zeros.t().contiguous().to(dtype))
