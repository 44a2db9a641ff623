"""GGUF quantization blocks decoded into integer codes with an affine map per group (torch, vectorised).

Every supported type is, per row and per group of ``group`` consecutive weights, ``w = S * u + O``
with integer codes ``u`` in ``[0, 2**bits)`` (layouts as in ggml's block structs, little-endian):

| type | block | bytes | per block | codes u | S, O |
| --- | --- | --- | --- | --- | --- |
| Q4_0 | 32 | 18 | f16 d, 16 B nibbles (low: weights 0-15, high: 16-31) | 4 bits | d, -8d |
| Q4_1 | 32 | 20 | f16 d, f16 m, 16 B nibbles | 4 bits | d, m |
| Q5_0 | 32 | 22 | f16 d, u32 high bits (bit j: weight j), 16 B nibbles | 5 bits | d, -16d |
| Q5_1 | 32 | 24 | f16 d, f16 m, u32 high bits, 16 B nibbles | 5 bits | d, m |
| Q8_0 | 32 | 34 | f16 d, 32 int8 | q + 128 | d, -128d |
| Q4_K | 256 | 144 | f16 d, dmin, 12 B of 6-bit scales/mins (8 groups of 32), 128 B nibbles | 4 bits | d sc, -dmin m |
| Q5_K | 256 | 176 | as Q4_K, then 32 B of high bits (bit g: group g), 128 B nibbles | 5 bits | d sc, -dmin m |
| Q6_K | 256 | 210 | 128 B low nibbles, 64 B 2-bit highs, 16 int8 scales (groups of 16), f16 d | 6 bits | d sc, -32dsc |

``to_planes`` splits the codes into 4-bit digits for int4 kernels with groups of 32: a b-bit code is
the sum of ceil(b/4) digit planes, plane i with scale ``16**i S`` (exact in float32). Groups of 16
(Q6_K) take two passes over the same 32-wide groups, each computing one 16-wide half and giving the
other half the code whose weight is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# type name -> (weights per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
SUPPORTED = tuple(BLOCKS)
PLANE_GROUP = 32  # the int4 kernels' group size


@dataclass
class Codes:
    """w[n, k] = scale[n, k // group] * codes[n, k] + offset[n, k // group]."""

    codes: torch.Tensor  # uint8 [N, K]
    scale: torch.Tensor  # float32 [N, K / group]
    offset: torch.Tensor  # float32 [N, K / group]
    group: int
    bits: int
    zero_code: int | None = None  # a code whose weight is 0 in every group (groups of 16 only)

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        u = self.codes.view(n, k // self.group, self.group).float()
        return (u * self.scale[..., None] + self.offset[..., None]).view(n, k)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian -> float32 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 16] -> codes [..., 32]: low nibbles (weights 0-15), then high nibbles (16-31)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _high_bits32(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4] (a little-endian u32) -> bits [..., 32], bit j of the word at j."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[..., :, None] >> shifts) & 1).flatten(-2)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte scale fields [..., 12] -> (scales, mins) [..., 8] as float32 (6 bits each)."""
    q = packed.to(torch.int32)
    sc_lo, m_lo = q[..., 0:4] & 63, q[..., 4:8] & 63
    sc_hi = (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)
    m_hi = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return torch.cat((sc_lo, sc_hi), -1).float(), torch.cat((m_lo, m_hi), -1).float()


def decode(raw: torch.Tensor, ggml_type: str) -> Codes:
    """Block rows uint8 [N, K / block * bytes] of one tensor -> its codes and per-group affine map."""
    elems, size = BLOCKS[ggml_type]
    n = raw.shape[0]
    b = raw.reshape(n, -1, size)
    if ggml_type in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = _f16(b[..., 0:2])
        if ggml_type == "Q8_0":
            codes = (b[..., 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
            return Codes(codes.reshape(n, -1), d, -128 * d, 32, 8)
        has_min = ggml_type.endswith("_1")
        start = 4 if has_min else 2
        if ggml_type.startswith("Q5"):
            high = _high_bits32(b[..., start:start + 4])
            codes = _nibbles(b[..., start + 4:start + 20]) | (high << 4)
            bits, mid = 5, 16
        else:
            codes = _nibbles(b[..., start:start + 16])
            bits, mid = 4, 8
        offset = _f16(b[..., 2:4]) if has_min else -mid * d
        return Codes(codes.reshape(n, -1), d, offset, 32, bits)
    if ggml_type in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mins = _k_scales(b[..., 4:16])  # [N, B, 8]
        qs = b[..., 16:144] if ggml_type == "Q4_K" else b[..., 48:176]
        qs = qs.reshape(n, -1, 4, 1, 32)  # 4 pairs of groups share 32 bytes: low nibbles, then high
        codes = torch.cat((qs & 0x0F, qs >> 4), dim=3).reshape(n, -1, 8, 32)
        bits = 4
        if ggml_type == "Q5_K":  # bit g of byte l: the high bit of weight l of group g
            shifts = torch.arange(8, dtype=torch.uint8)[:, None]
            high = (b[..., 16:48][:, :, None, :] >> shifts) & 1  # [N, B, 8, 32]
            codes = codes | (high << 4)
            bits = 5
        scale = (d[..., None] * sc).reshape(n, -1)
        offset = (-dmin[..., None] * mins).reshape(n, -1)
        return Codes(codes.reshape(n, -1), scale, offset, 32, bits)
    if ggml_type == "Q6_K":
        ql = b[..., 0:128].reshape(n, -1, 2, 2, 32)  # [half][first/second 32 bytes]
        qh = b[..., 128:192].reshape(n, -1, 2, 1, 32)
        sc = b[..., 192:208].view(torch.int8).float()  # [N, B, 16]
        d = _f16(b[..., 208:210])
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
        high = (qh >> shifts) & 3  # [N, B, 2, 4, 32]: the highs of the 4 runs of 32 in a half
        low = torch.cat((ql & 0x0F, ql >> 4), dim=3)  # runs: ql[0:32] low, ql[32:64] low, ql[0:32] high, ...
        codes = (low | (high << 4)).reshape(n, -1)
        scale = (d[..., None] * sc).reshape(n, -1)
        return Codes(codes, scale, -32 * scale, 16, 6, zero_code=32)
    raise ValueError(f"GGUF type {ggml_type} has no packed decoder (supported: {', '.join(SUPPORTED)})")


@dataclass
class Plane:
    """One int4 term: w_term[n, k] = (codes[n, k] - 8) * scale[n, g] + zero[n, g], g = k // 32."""

    codes: torch.Tensor  # uint8 [N, K], 0..15
    scale: torch.Tensor  # float32 [N, K / 32]
    zero: torch.Tensor  # float32 [N, K / 32]


def to_planes(c: Codes) -> list[Plane]:
    """4-bit digit planes whose terms sum to the weights (see the module docstring)."""
    digits = -(-c.bits // 4)
    if c.group == PLANE_GROUP:
        return [_digit_plane(c.codes, c.scale, c.offset if i == 0 else None, i) for i in range(digits)]
    if c.group != 16 or c.zero_code is None:
        raise ValueError(f"groups of {c.group} cannot be split into int4 planes of groups of {PLANE_GROUP}")
    n, k = c.codes.shape
    planes = []
    for half in (0, 1):
        own = (torch.arange(k) // 16) % 2 == half  # positions of this pass's 16-wide groups
        codes = torch.where(own, c.codes, torch.full_like(c.codes, c.zero_code))
        scale = c.scale.view(n, -1, 2)[..., half]
        offset = c.offset.view(n, -1, 2)[..., half]
        planes += [_digit_plane(codes, scale, offset if i == 0 else None, i) for i in range(digits)]
    return planes


def _digit_plane(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, i: int) -> Plane:
    s = scale * float(16 ** i)
    z = 8 * s if offset is None else 8 * s + offset
    return Plane(((codes >> (4 * i)) & 0x0F).to(torch.uint8), s, z)
