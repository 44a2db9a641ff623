"""Every decoder layer of a Llama-shaped model for one decode step in one C call, on the CPU.

Why: with the GGUF weights multiplied by C kernels, a single-stream decode step on the default model
(SmolLM2-135M, 30 layers) spent about 4 of its 21 ms in Python between those kernels: module calls,
wrappers, output allocations, about 130 us per layer (docs/benchmarks.md, CPU section). ``cpu_ops.c``'s
``pagoda_decoder_decode`` runs the whole stack instead (norms, projections, q/k norms, rotary, the cache
store, decode attention, the gated MLP), calling the same C functions as the per-op path in the same
order. It knows no weight format: each projection's quantization method gives C functions for its
output columns (``QuantMethod.native_parts``, ``NativeLinearPart``); a layer whose method gives none keeps
the per-op path, as does every step that is not all decodes (a prefill chunk's float GEMMs and
``cpu_sdpa`` are the faster path there).

What a model gives: ``DecoderLayerParts`` per layer (``LlamaDecoderLayer.fused_decode_parts``). Applies
when every layer has them and: float32 weights and caches on the CPU, the C library built, RMS norms without
offset, a SiLU-gated MLP, one rotary table without a long-context switch, plain attention (no soft cap,
sinks or quantized cache), no tensor parallelism or LoRA, and the CPU platform's own ops (a plugin that
replaces one of them keeps the per-op path). ``PAGODA_CPU_FUSED_DECODE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.kernels import cpu_ops

_P, _I = ctypes.c_void_p, ctypes.c_int64
F32 = torch.float32


@dataclass(frozen=True)
class NativeLinearPart:
    """Output columns of a linear map computed by a C function
    ``int fn(const void *weight, const float *x, int64_t m, float *out, int64_t ldo, int threads)``
    (x [m, inputs] contiguous; out's rows ``ldo`` floats apart; 0 on success). ``keep`` holds whatever the
    two addresses point into."""

    fn: int
    weight: int
    rows: int
    inputs: int
    keep: Any = None


@dataclass(frozen=True)
class DecoderLayerParts:
    """A Llama-shaped decoder layer's pieces: norm -> qkv -> (q/k norm) -> rotary -> attention -> o ->
    norm -> gate_up -> act -> down, with residual adds."""

    input_norm: Any
    post_attention_norm: Any
    qkv: Any
    o: Any
    gate_up: Any
    down: Any
    rotary: Any
    attention: Any
    activation: Any
    q_norm: Any = None
    k_norm: Any = None


class _Part(ctypes.Structure):
    _fields_ = [("fn", _P), ("weight", _P), ("rows", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("ln1", "ln2", "q_norm", "k_norm", "qkv_bias", "o_bias", "qkv", "o",
                                        "gate_up", "down")] + \
               [(name, _I) for name in ("n_qkv", "n_o", "n_gate_up", "n_down")] + \
               [("k_cache", _P), ("v_cache", _P), ("window", _I)]


class _Dims(ctypes.Structure):
    _fields_ = [(name, _I) for name in ("hidden", "nq", "nk", "hd", "inter", "rot", "npos", "slots")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("neox", _I), ("cos_sin", _P)]


def enabled() -> bool:
    return os.environ.get("PAGODA_CPU_FUSED_DECODE", "1") not in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=1)
def _function():
    lib = cpu_ops._lib()
    if lib is None:
        return None
    fn = lib.pagoda_decoder_decode
    fn.argtypes = [_P, _P, _I, _P, _I, _P, _P, _I, _P, _I, _P, ctypes.c_int]
    fn.restype = _I
    return fn


def _f32(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype is F32 and t.device.type == "cpu" and t.is_contiguous()


def _ptr(t) -> int | None:
    return None if t is None else t.data_ptr()


def _linear_parts(layer) -> list[NativeLinearPart] | None:
    from pagoda.layers.linear import LinearBase

    method = getattr(layer, "quant_method", None)
    native = getattr(method, "native_parts", None)
    if not isinstance(layer, LinearBase) or native is None or getattr(layer, "tp_size", 1) != 1:
        return None
    parts = native(layer)
    if (not parts or sum(p.rows for p in parts) != sum(layer.output_partition_sizes)
            or any(p.inputs != layer.input_size_per_partition for p in parts)):
        return None
    bias = getattr(layer, "bias", None)
    return parts if bias is None or _f32(bias) else None


def _platform_ops() -> bool:
    """Whether the step's small ops are the CPU platform's own (what the C stack computes)."""
    from pagoda.kernels import get_op

    try:
        return all(get_op(name) is getattr(cpu_ops, name) for name in
                   ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "store_kv_cache"))
    except Exception:  # noqa: BLE001 - an op not registered: the per-op path decides what to do
        return False


class CpuDecoderStack:
    """The C description of a model's decoder layers; ``run`` one all-decode step, or None."""

    def __init__(self, parts: list[DecoderLayerParts], linears: list[list[list[NativeLinearPart]]]):
        self.parts, first = parts, parts[0]
        att, rope = first.attention.spec, first.rotary
        self.hidden = first.input_norm.weight.shape[0]
        self.dims = _Dims(hidden=self.hidden, nq=att.num_heads, nk=att.num_kv_heads, hd=att.head_size,
                          inter=sum(first.gate_up.output_partition_sizes) // 2, rot=rope.cos_sin_cache.shape[1],
                          npos=rope.cos_sin_cache.shape[0], slots=0, eps=first.input_norm.eps, scale=att.scale,
                          neox=int(bool(rope.is_neox)), cos_sin=rope.cos_sin_cache.data_ptr())
        self._keep = [rope.cos_sin_cache, linears]
        self.layers = (_Layer * len(parts))()
        for i, (p, lin) in enumerate(zip(parts, linears)):
            arrays = [(_Part * len(ps))(*[_Part(x.fn, x.weight, x.rows) for x in ps]) for ps in lin]
            self._keep.append(arrays)
            q_norm = p.q_norm.weight if p.q_norm is not None else None
            k_norm = p.k_norm.weight if p.k_norm is not None else None
            self.layers[i] = _Layer(
                ln1=p.input_norm.weight.data_ptr(), ln2=p.post_attention_norm.weight.data_ptr(), q_norm=_ptr(q_norm),
                k_norm=_ptr(k_norm), qkv_bias=_ptr(p.qkv.bias), o_bias=_ptr(p.o.bias),
                qkv=ctypes.addressof(arrays[0]), o=ctypes.addressof(arrays[1]), gate_up=ctypes.addressof(arrays[2]),
                down=ctypes.addressof(arrays[3]), n_qkv=len(lin[0]), n_o=len(lin[1]), n_gate_up=len(lin[2]),
                n_down=len(lin[3]), k_cache=None, v_cache=None, window=p.attention.spec.sliding_window or 0)
        self._caches: list = []

    @classmethod
    def build(cls, parts: list[DecoderLayerParts | None]) -> CpuDecoderStack | None:
        """The stack, or None where any layer or setting is outside what the C code computes."""
        from pagoda.layers.activation import GatedActivation
        from pagoda.layers.norm import RMSNorm
        from pagoda.layers.rotary import RotaryEmbedding

        if not parts or not enabled() or _function() is None or not _platform_ops() or any(p is None for p in parts):
            return None
        first = parts[0]
        linears = []
        for p in parts:
            norms = [p.input_norm, p.post_attention_norm] + ([p.q_norm, p.k_norm] if p.q_norm is not None else [])
            if (p.q_norm is None) != (p.k_norm is None) or not all(
                    type(n) is RMSNorm and n.offset is None and _f32(n.weight) and n.eps == first.input_norm.eps
                    for n in norms):
                return None
            rope, att = p.rotary, p.attention
            if (type(rope) is not RotaryEmbedding or rope is not first.rotary or rope.long_threshold is not None
                    or not _f32(rope.cos_sin_cache) or rope.cos_sin_cache.shape[1] % 2
                    or rope.cos_sin_cache.shape[1] > att.spec.head_size):
                return None
            spec, spec0 = att.spec, first.attention.spec
            if (att.kind != "mha" or spec.logits_soft_cap or spec.sinks or att.kv_group != first.attention.kv_group
                    or (spec.num_heads, spec.num_kv_heads, spec.head_size, spec.scale)
                    != (spec0.num_heads, spec0.num_kv_heads, spec0.head_size, spec0.scale)):
                return None
            if not (isinstance(p.activation, GatedActivation) and p.activation.op == "silu_and_mul"):
                return None
            lin = [_linear_parts(m) for m in (p.qkv, p.o, p.gate_up, p.down)]
            if any(x is None for x in lin) or p.gate_up.bias is not None or p.down.bias is not None:
                return None
            # the shapes the C code assumes (each part reads `inputs` floats per row: checked above)
            hidden, inter2 = first.input_norm.weight.shape[0], sum(p.gate_up.output_partition_sizes)
            heads = spec.num_heads * spec.head_size
            if (p.qkv.input_size_per_partition != hidden or p.gate_up.input_size_per_partition != hidden
                    or sum(p.qkv.output_partition_sizes) != heads + 2 * spec.num_kv_heads * spec.head_size
                    or p.o.input_size_per_partition != heads or sum(p.o.output_partition_sizes) != hidden
                    or inter2 % 2 or p.down.input_size_per_partition != inter2 // 2
                    or sum(p.down.output_partition_sizes) != hidden
                    or p.post_attention_norm.weight.shape[0] != hidden):
                return None
            linears.append(lin)
        return cls(parts, linears)

    def _bind_caches(self) -> bool:
        """Point the C layers at the attention layers' current caches (re-bound after a reallocation)."""
        caches = [p.attention.kv_cache for p in self.parts]
        if len(caches) == len(self._caches) and all(a is b for a, b in zip(caches, self._caches)):
            return True
        for c in caches:
            if (not _f32(c) or c.dim() != 5 or c.shape[0] != 2 or c.shape[1:3] != caches[0].shape[1:3]
                    or c.shape[3:] != (self.dims.nk, self.dims.hd)):
                return False
        slots = caches[0].shape[1] * caches[0].shape[2]
        for layer, c in zip(self.layers, caches):
            base = c.data_ptr()
            layer.k_cache, layer.v_cache = base, base + slots * self.dims.nk * self.dims.hd * 4
        self.dims.slots = slots
        self._caches = caches
        return True

    def run(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """hidden [T, H] (the embedding) -> the residual stream after the last layer [T, H] (before the final
        norm), or None when this step is not one the stack computes (the per-op path then runs it)."""
        from pagoda.attention.cpu_sdpa import CpuSdpaAttention, CpuStepData
        from pagoda.forward_context import get_forward_context

        ctx = get_forward_context()
        att = self.parts[0].attention
        t = hidden.shape[0]
        if (ctx.attention_probe is not None or ctx.lora is not None
                or not isinstance(ctx.backends.get("mha"), CpuSdpaAttention) or not _f32(hidden)
                or hidden.dim() != 2 or hidden.shape[1] != self.hidden or positions.dtype is not torch.int64
                or not positions.is_contiguous() or positions.shape[0] != t):
            return None
        meta = ctx.metadata_for(att.kind, att.kv_group)
        if (meta is None or meta.for_graph or meta.num_decodes != meta.num_seqs or meta.num_tokens != t
                or meta.num_seqs != t or not self._bind_caches()):
            return None
        slots = meta.slot_mapping[:t]
        if slots.dtype is not torch.int64 or not slots.is_contiguous():
            return None
        data = meta.backend_data if isinstance(meta.backend_data, CpuStepData) else CpuStepData(meta)
        tables, lens = data.decode_inputs()
        x = hidden.clone()
        rc = _function()(ctypes.addressof(self.dims), ctypes.addressof(self.layers), len(self.parts), x.data_ptr(), t,
                         positions.data_ptr(), slots.data_ptr(), meta.block_size, tables.data_ptr(),
                         tables.stride(0), lens.data_ptr(), torch.get_num_threads())
        if rc == -1:
            raise MemoryError("fused CPU decode: no memory for a step's activations (or a linear map failed)")
        if rc <= -2:
            r = -2 - rc
            raise IndexError(f"fused CPU decode: row {r}: position {int(positions[r])} (cos/sin table of "
                             f"{self.dims.npos} rows) or slot {int(slots[r])} (cache of {self.dims.slots} slots) "
                             "is out of range")
        return x


class FusedDecode:
    """What a model keeps: the stack, built at the first step that could use it (the caches and weights are in
    place by then), or a note that this model cannot."""

    def __init__(self, layer_parts):
        self._layer_parts = layer_parts  # () -> list[DecoderLayerParts | None]
        self._stack: CpuDecoderStack | None | bool = False  # False: not built yet

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        if hidden.device.type != "cpu":
            return None
        if self._stack is False:
            self._stack = CpuDecoderStack.build(self._layer_parts())
        return None if self._stack is None else self._stack.run(hidden, positions)
