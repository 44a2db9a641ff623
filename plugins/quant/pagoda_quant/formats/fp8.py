"""FP8 (e4m3) number format: scales, quantization and dequantization in plain torch.

Conventions (the same as the checkpoints pagoda reads):
  * a *scale* multiplies the fp8 value back to full precision: ``w ≈ q.float() * scale``;
  * values are divided by their scale, clamped to ±448 (e4m3's largest finite value) and
    rounded to nearest by the cast, so no value overflows to NaN;
  * block-scaled weights (DeepSeek-V3) hold one scale per ``[block_n, block_k]`` tile in
    ``weight_scale_inv`` of shape ``[ceil(N / block_n), ceil(K / block_k)]`` — despite its name
    it is also a dequantization multiplier.

Every function works on any device and returns new tensors.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Smallest scale used for an all-zero row/tile, so that dividing by it stays finite.
MIN_SCALE = 1e-12


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(x / scale, ±448)`` as float8_e4m3fn; ``scale`` broadcasts against ``x``."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def scale_for(amax: torch.Tensor) -> torch.Tensor:
    """The scale that maps ``amax`` onto the largest fp8 value (float32)."""
    return (amax.float() / FP8_MAX).clamp_(min=MIN_SCALE)


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [...] -> (q fp8 [...], scale float32 [])."""
    scale = scale_for(w.abs().amax())
    return cast_to_fp8(w, scale), scale


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q fp8 [N, K], scale float32 [N]): one scale per output row."""
    scale = scale_for(w.abs().amax(dim=-1))
    return cast_to_fp8(w, scale.unsqueeze(-1)), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x [T, K] -> (q fp8 [T, K], scale float32 [T, 1])."""
    scale = scale_for(x.abs().amax(dim=-1, keepdim=True))
    return cast_to_fp8(x, scale), scale


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's activation scheme: one scale per token and per ``group`` input columns.

    x [T, K] -> (q fp8 [T, K], scale float32 [T, ceil(K / group)]).
    """
    t, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(t, groups, group)
    scale = scale_for(padded.abs().amax(dim=-1))
    q = cast_to_fp8(padded, scale.unsqueeze(-1)).view(t, groups * group)[:, :k]
    return q, scale


def _tiles(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """Pad w [N, K] to whole tiles and view it as [N/bn, bn, K/bk, bk] (float32)."""
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.float(), (0, cols * bk - k, 0, rows * bn - n))
    return padded.view(rows, bn, cols, bk), rows, cols


def quantize_blockwise(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q fp8 [N, K], weight_scale_inv float32 [ceil(N/bn), ceil(K/bk)])."""
    n, k = w.shape
    tiles, _, _ = _tiles(w, block)
    scale = scale_for(tiles.abs().amax(dim=(1, 3)))
    q = cast_to_fp8(tiles, scale[:, None, :, None])
    return q.view(tiles.shape[0] * block[0], -1)[:n, :k].contiguous(), scale


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """weight_scale_inv [N/bn, K/bk] -> one scale per element [N, K] (float32)."""
    n, k = shape
    full = scale.float().repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[:n, :k]


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q fp8 [N, K], weight_scale_inv [N/bn, K/bk]) -> w [N, K] in ``dtype``."""
    return (q.float() * expand_block_scale(scale, tuple(q.shape), block)).to(dtype)


def dequantize_per_group(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """(q fp8 [T, K], scale [T, ceil(K/group)]) -> float32 [T, K]."""
    k = q.shape[-1]
    return q.float() * scale.float().repeat_interleave(group, dim=-1)[..., :k]
