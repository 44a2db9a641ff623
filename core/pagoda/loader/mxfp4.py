"""MXFP4 (OCP microscaling, 4-bit e2m1 values in blocks of 32 sharing one e8m0 scale), as the
published GPT-OSS checkpoints store their experts:

    <name>_blocks [..., R, C / 32, 16] uint8   two e2m1 codes per byte, the low nibble first
    <name>_scales [..., R, C / 32]     uint8   the block's power of two, biased by 127

``dequantize_mxfp4`` returns the [..., R, C] values. pagoda has no MXFP4 matrix kernel: the
experts are dequantized once at load to the model dtype (the model says so in the log), so
they take the memory of a bf16 checkpoint. ``quantize_mxfp4`` is the inverse (nearest e2m1
value under the block's largest power-of-two scale), for tests and tiny checkpoints.
"""

from __future__ import annotations

import torch
from pagoda.errors import ModelLoadError

# the 16 e2m1 codes: sign bit 3, then exponent and mantissa
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     name: str = "tensor") -> torch.Tensor:
    """blocks [..., R, G, 16] uint8, scales [..., R, G] uint8 -> [..., R, G * 32] in ``dtype``."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ModelLoadError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
                             f"match (expected [..., G, {BLOCK // 2}] and [..., G])")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.uint8)
    values = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1)  # [..., G, 16, 2]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(values.flatten(-2), exponents.unsqueeze(-1))  # [..., G, 32]
    return out.flatten(-2).to(dtype)


def quantize_mxfp4(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., R, C] (C a multiple of 32) -> (blocks [..., R, C/32, 16] uint8, scales [..., R, C/32]
    uint8): each block scaled by the power of two that brings its largest magnitude to at most 6,
    every value rounded to the nearest e2m1 code."""
    if values.shape[-1] % BLOCK:
        raise ValueError(f"quantize_mxfp4: the last dimension ({values.shape[-1]}) is not a multiple of {BLOCK}")
    grouped = values.float().unflatten(-1, (-1, BLOCK))  # [..., G, 32]
    top = grouped.abs().amax(-1).clamp_min(2.0 ** -126)
    exponent = torch.ceil(torch.log2(top / 6.0)).clamp(-SCALE_BIAS, 127)
    scaled = grouped / torch.exp2(exponent).unsqueeze(-1)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + SCALE_BIAS).to(torch.uint8)
