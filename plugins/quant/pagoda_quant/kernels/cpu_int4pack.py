"""Packed int4 weights on the CPU through torch's own kernel, ``aten._weight_int4pack_mm_for_cpu``.

The kernel computes ``x @ W.T`` with W held as 4-bit codes packed by
``aten._convert_weight_to_int4pack_for_cpu`` and, per group of 32 inputs and output row, a
(scale, zero) pair: ``w = (code - 8) * scale + zero``. On x86 it is vectorised for bfloat16
activations only (float32 falls to a scalar loop), so rows are cast to bfloat16 for it and the
bfloat16 result back. Its cost per row is a dequantisation plus a multiply-add per weight, fine
for decode batches; for many rows (a prefill chunk) the weights are widened to float32 once per
call and go through the float GEMM instead (``DEQUANT_ROWS``).

A weight of several planes (``gguf_blocks.to_planes``) sums one kernel call per plane.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# rows from which a call widens the weights and runs the float GEMM (the int4 kernel's per-row cost
# then exceeds the widening's one-off pass over the weights)
DEQUANT_ROWS = 128
GROUP = 32


@functools.lru_cache(maxsize=1)
def kernel_available() -> bool:
    """Whether this torch has the CPU int4 kernels (torch >= 2.5)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
        hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


class PackedPlane:
    """One plane in the kernel's layout: packed codes and bfloat16 scales/zeros [K/32, N, 2]."""

    __slots__ = ("packed", "scales_zeros", "codes", "n", "k")

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
        n, k = codes.shape
        self.n, self.k = n, k
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        self.scales_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        # codes kept for widening only where the packed layout cannot be read back (see unpack_layout)
        layout = unpack_layout()
        self.codes = None if layout is not None and n % layout.block == 0 else _pack_nibbles(codes)

    @classmethod
    def empty_like(cls, part: PackedPlane, rows: int) -> PackedPlane:
        """An unfilled plane of ``rows`` rows shaped like ``part`` (filled by ``write_rows``; packing works
        on blocks of 32 rows, so parts of multiples of 64 rows pack as the whole would)."""
        out = cls.__new__(cls)
        out.n, out.k = rows, part.k
        out.packed = part.packed.new_empty((rows, *part.packed.shape[1:]))
        out.scales_zeros = part.scales_zeros.new_empty((part.scales_zeros.shape[0], rows, 2))
        out.codes = None if part.codes is None else part.codes.new_empty((rows, *part.codes.shape[1:]))
        return out

    def write_rows(self, start: int, part: PackedPlane) -> None:
        self.packed[start:start + part.n].copy_(part.packed)
        self.scales_zeros[:, start:start + part.n].copy_(part.scales_zeros)
        if self.codes is not None:
            self.codes[start:start + part.n].copy_(part.codes)

    def nbytes(self) -> int:
        extra = self.codes.numel() if self.codes is not None else 0
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2 + extra

    def mm(self, xb: torch.Tensor) -> torch.Tensor:
        """xb [M, K] bfloat16 -> [M, N] bfloat16."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP, self.scales_zeros)

    def widen(self) -> torch.Tensor:
        """This plane's term of the weight, float32 [N, K]."""
        codes = _unpack_nibbles(self.codes) if self.codes is not None else unpack_layout()(self.packed, self.n)
        sz = self.scales_zeros.float()  # [K/32, N, 2]
        scale, zero = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]  # [N, K/32, 1]
        w = (codes.view(self.n, self.k // GROUP, GROUP).float() - 8.0) * scale + zero
        return w.view(self.n, self.k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of this plane's term, float32 [len(ids), K] (an embedding lookup)."""
        if self.codes is not None:
            codes = _unpack_nibbles(self.codes.index_select(0, ids))
        else:
            codes = unpack_layout()(self.packed, self.n, ids)
        sz = self.scales_zeros.index_select(1, ids).float()  # [K/32, T, 2]
        scale, zero = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]
        t = ids.shape[0]
        return ((codes.view(t, -1, GROUP).float() - 8.0) * scale + zero).view(t, self.k)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def _unpack_blocks(packed: torch.Tensor, n: int, ids: torch.Tensor | None = None, block: int = 32) -> torch.Tensor:
    """torch's packed layout on x86: uint8 [N/B, K, B/2] for blocks of B rows (32 with AVX2, 64 with
    AVX-512), byte j of (block b, k) = code[B b + j, k] | code[B b + B/2 + j, k] << 4.
    -> codes uint8 [N, K] (or [len(ids), K])."""
    half = block // 2
    blocks = packed.view(n // block, -1, half)
    if ids is None:
        both = torch.stack((blocks & 0x0F, blocks >> 4), dim=1)  # [N/B, 2, K, B/2]
        return both.permute(0, 1, 3, 2).reshape(n, -1)
    rows = blocks.index_select(0, ids // block)  # [T, K, B/2]
    j = (ids % block)[:, None, None]
    byte = torch.gather(rows, 2, (j % half).expand(-1, rows.shape[1], 1)).squeeze(-1)  # [T, K]
    return torch.where(j[:, :, 0] < half, byte & 0x0F, byte >> 4)


@functools.lru_cache(maxsize=1)
def unpack_layout():
    """A reader of the packed layout when it is one this module knows (torch's AVX2 or AVX-512 layout,
    checked here on a probe matrix), else None: then planes keep their codes a second time. The reader has
    ``block``: the rows a packed block holds (a plane of other row counts keeps its codes too)."""
    if not kernel_available():
        return None
    probe = torch.arange(128 * 64, dtype=torch.int32).view(128, 64) % 16
    probe = (probe + 3 * torch.arange(128, dtype=torch.int32)[:, None]) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    ids = torch.tensor([0, 17, 33, 63, 64, 100, 127])
    for block in (32, 64):
        try:
            if (packed.numel() == 128 * 32 and torch.equal(_unpack_blocks(packed, 128, block=block).int(), probe)
                    and torch.equal(_unpack_blocks(packed, 128, ids, block).int(), probe[ids])):
                reader = functools.partial(_unpack_blocks, block=block)
                reader.block = block
                return reader
        except RuntimeError:
            pass
    return None


def planes_linear(x: torch.Tensor, planes: list[PackedPlane], bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (any float dtype) @ (sum of the planes' terms).T (+ bias) -> [..., N] in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[0] >= DEQUANT_ROWS:
        w = planes[0].widen()
        for p in planes[1:]:
            w += p.widen()
        out = F.linear(x2, w.to(x2.dtype), bias)
    else:
        xb = x2.to(torch.bfloat16)
        out = planes[0].mm(xb).to(x2.dtype)
        for p in planes[1:]:
            out += p.mm(xb)
        if bias is not None:
            out += bias
    return out.view(*shape[:-1], out.shape[-1])
