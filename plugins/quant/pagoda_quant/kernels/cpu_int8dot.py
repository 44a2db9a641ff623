"""GGUF weights times int8-quantized activations on x86 CPUs: integer dot products, as llama.cpp computes.

Why a C kernel of our own: torch's CPU kernels for low-bit weights (``_weight_int4pack_mm_for_cpu``,
``_weight_int8pack_mm``) widen every weight to float and multiply in float, which on AVX2 costs about as
much per step as llama.cpp's whole step (docs/benchmarks.md, CPU section); torchao's integer kernels
need AVX-512 VNNI or ARM. llama.cpp instead quantizes each activation row to int8 per 32 inputs and
multiplies 8-bit integers (``vpmaddubsw``, or ``vpdpbusd`` where the CPU has VNNI), four times the work per
instruction. ``cpu_int8dot.c``
does the same for two weight layouts (4-bit codes two per byte; signed 8-bit codes), with the GGUF
types decoded into them at load (``formats.gguf_blocks``). It is compiled at first use with the
system's C compiler (``pagoda.kernels.native``); without a compiler, or on a CPU without AVX2 and
FMA, ``available()`` is False and the GGUF method uses torch's int4 kernel instead
(``PAGODA_CPU_GGUF_KERNEL=int4pack`` chooses that path explicitly).

Precision: the activations carry int8 rounding per 32 inputs (about 1/254 of the group's largest
value), as in llama.cpp; the weights are exact.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_int8dot.c")
Q4, I8 = 0, 1  # the two weight layouts
F32 = torch.float32


@functools.lru_cache(maxsize=1)
def _library():
    """The compiled kernel (ctypes), or None where it cannot be built or the CPU lacks AVX2/FMA."""
    from pagoda.kernels.native import load

    lib = load(SOURCE)
    if lib is None or not lib.pagoda_simd():
        return None
    fn = lib.pagoda_int8dot_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    widen = lib.pagoda_int8dot_widen
    widen.restype = None
    widen.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                      ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    fn.widen = widen
    fn.apply_address = ctypes.cast(lib.pagoda_int8dot_apply, ctypes.c_void_p).value
    return fn


class _Described(ctypes.Structure):
    """cpu_int8dot.c's ``struct pagoda_dot_weight``."""

    _fields_ = [("codes", ctypes.c_void_p), ("S", ctypes.c_void_p), ("O", ctypes.c_void_p)] + \
               [(name, ctypes.c_int64) for name in ("k", "n", "layout", "group", "f16")]


PREFILL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@functools.lru_cache(maxsize=1)
def prefill_dtype() -> torch.dtype:
    """The dtype of a prefill chunk's GEMM over widened GGUF weights (``PAGODA_CPU_PREFILL_DTYPE``):
    ``auto`` (the default) takes bfloat16 where the CPU multiplies it in hardware (AMX, or AVX-512 BF16's
    dot-product instructions: torch's oneDNN GEMM there is 2-4x, resp. 2-2.7x the float32 one), else
    float32. The weights and activations are then rounded to bfloat16 (8 bits of mantissa: about 0.4% of
    a value, a finer rounding than the int8 activations of decode steps), the products summed in float32."""
    choice = os.environ.get("PAGODA_CPU_PREFILL_DTYPE", "auto")
    if choice == "auto":
        return torch.bfloat16 if _multiplies_bfloat16() else torch.float32
    if choice not in PREFILL_DTYPES:
        from pagoda.errors import ConfigError

        raise ConfigError(f"PAGODA_CPU_PREFILL_DTYPE={choice!r}: expected auto, {', '.join(PREFILL_DTYPES)}")
    return PREFILL_DTYPES[choice]


def _multiplies_bfloat16() -> bool:
    """Whether this CPU has bfloat16 multiply instructions (AMX tiles or AVX-512 BF16)."""
    return any(getattr(torch.cpu, name, lambda: False)()
               for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))


def available() -> bool:
    """Whether the kernel is usable here (x86 with AVX2 and FMA, a C compiler, not turned off)."""
    if os.environ.get("PAGODA_CPU_GGUF_KERNEL", "auto") == "int4pack":
        return False
    return _library() is not None


class DotWeight:
    """One weight in a layout of ``cpu_int8dot.c``: w[n, k] = scale[n, k // group] * code[n, k] + offset[...].

    Scales and offsets are kept in float16 where that holds every value exactly (the GGUF types whose
    block scales are float16: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), else float32 (K-quants' products of two
    scales); an offset of 0 everywhere (Q8_0) is not kept at all. Decode reads every weight byte once per
    step and is bound by memory bandwidth, so these bytes count: Q4_1 then takes the file's 20 bytes per
    32 weights, Q8_0 its 34."""

    __slots__ = ("layout", "group", "codes", "scale", "offset", "n", "k", "f16", "_described")

    def __init__(self, layout: int, group: int, codes: torch.Tensor, scale: torch.Tensor,
                 offset: torch.Tensor | None):
        self.layout, self.group = layout, group
        self.codes, self.scale = codes.contiguous(), scale.contiguous()
        self.offset = None if offset is None else offset.contiguous()
        self.f16 = scale.dtype == torch.float16
        if offset is not None and offset.dtype != scale.dtype:
            raise ValueError("DotWeight: scale and offset must share a dtype")
        self.n = codes.shape[0]
        self.k = codes.shape[1] * (2 if layout == Q4 else 1)
        self._described = None

    @classmethod
    def from_codes(cls, c, compact: bool = True) -> DotWeight:
        """From ``gguf_blocks.Codes``: 4-bit codes packed two per byte, wider codes as signed bytes
        (codes of 8 bits are shifted by -128, the offset taking the shift); float32 scales and offsets
        unless ``compact`` (then ``compact()``'s)."""
        n, k = c.codes.shape
        scale, offset = c.scale.float(), c.offset.float()
        if c.bits <= 4 and c.group == 32:
            g = c.codes.view(n, k // 32, 2, 16)
            layout, group, codes = Q4, 32, (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)
        elif c.bits <= 7:
            layout, group, codes = I8, c.group, c.codes.view(torch.int8)
        else:
            layout, group, codes = I8, c.group, (c.codes.to(torch.int16) - 128).to(torch.int8)
            offset = offset + 128 * scale
        weight = cls(layout, group, codes, scale, offset)
        return weight.compact() if compact else weight

    def compact(self) -> DotWeight:
        """The same weight with float16 scales and offsets where that is exact, without all-zero offsets."""
        scale, offset = self.scale, self.offset
        if scale.dtype == torch.float32 and _exact_in_f16(scale) and (offset is None or _exact_in_f16(offset)):
            scale, offset = scale.half(), None if offset is None else offset.half()
        if offset is not None and not bool(offset.any()):
            offset = None
        return DotWeight(self.layout, self.group, self.codes, scale, offset)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x float32 [M, K] (contiguous) -> [M, N] float32."""
        m = x.shape[0]
        out = torch.empty(m, self.n, dtype=F32)
        offset = 0 if self.offset is None else self.offset.data_ptr()
        rc = _library()(x.data_ptr(), m, self.k, self.n, self.layout, self.group, self.codes.data_ptr(),
                        self.scale.data_ptr(), offset, self.f16, out.data_ptr(), torch.get_num_threads())
        if rc:
            raise MemoryError(f"int8 dot-product kernel: no scratch memory for {m} rows of {self.k}")
        return out

    def native(self):
        """(address of ``pagoda_int8dot_apply``, address of this weight's C description, the description) for
        a C caller (the core's fused CPU decode: ``pagoda.kernels.cpu_decoder.NativeLinearPart``), or None
        where the kernel is not built."""
        lib = _library()
        if lib is None:
            return None
        if self._described is None:
            self._described = _Described(self.codes.data_ptr(), self.scale.data_ptr(),
                                         0 if self.offset is None else self.offset.data_ptr(), self.k, self.n,
                                         self.layout, self.group, int(self.f16))
        return lib.apply_address, ctypes.addressof(self._described), self._described

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (a prefill chunk's rows) @ W.T through the widened weight and torch's GEMM, in
        ``prefill_dtype()``; the result in x's dtype."""
        dtype = prefill_dtype()
        if dtype is torch.float32:
            return torch.nn.functional.linear(x, self.widen().to(x.dtype))
        return torch.nn.functional.linear(x.to(dtype), self.widen().to(dtype)).to(x.dtype)

    def widen(self) -> torch.Tensor:
        """The weight, float32 [N, K] (in C where the kernel is built: a prefill widens every weight per call)."""
        lib = _library()
        if lib is not None:
            out = torch.empty(self.n, self.k, dtype=F32)
            offset = 0 if self.offset is None else self.offset.data_ptr()
            lib.widen(self.k, self.n, self.layout, self.group, self.codes.data_ptr(), self.scale.data_ptr(), offset,
                      self.f16, out.data_ptr(), torch.get_num_threads())
            return out
        return self.widen_reference()

    def widen_reference(self) -> torch.Tensor:
        """``widen`` in torch ops (the reference the C version equals bit for bit)."""
        w = self._codes(None).float().view(self.n, -1, self.group) * self.scale.float()[..., None]
        if self.offset is not None:
            w += self.offset.float()[..., None]
        return w.view(self.n, self.k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids``, float32 [len(ids), K] (an embedding lookup)."""
        t = ids.shape[0]
        w = self._codes(ids).float().view(t, -1, self.group) * self.scale[ids].float()[..., None]
        if self.offset is not None:
            w += self.offset[ids].float()[..., None]
        return w.view(t, self.k)

    def _codes(self, ids: torch.Tensor | None) -> torch.Tensor:
        codes = self.codes if ids is None else self.codes.index_select(0, ids)
        if self.layout == I8:
            return codes
        g = codes.view(codes.shape[0], -1, 16)
        return torch.stack((g & 0x0F, g >> 4), dim=2).reshape(codes.shape[0], -1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset) if t is not None)

    def state(self) -> dict:
        return {"layout": self.layout, "group": self.group, "codes": self.codes, "scale": self.scale,
                "offset": self.offset}

    @classmethod
    def from_state(cls, d: dict) -> DotWeight:
        return cls(d["layout"], d["group"], d["codes"], d["scale"], d["offset"])


def _exact_in_f16(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.half().float(), t))


def dot_linear(x: torch.Tensor, weight: DotWeight) -> torch.Tensor:
    """x [..., K] (any float dtype) @ W.T -> [..., N] in x's dtype."""
    if x.dtype is F32 and x.dim() == 2 and x.is_contiguous():  # a decode step's rows: no conversions
        return weight.mm(x)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = weight.mm(x2.to(torch.float32).contiguous())
    return out.to(x.dtype).view(*shape[:-1], weight.n)
