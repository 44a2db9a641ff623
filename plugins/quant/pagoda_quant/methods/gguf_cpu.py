"""``quantization: gguf`` on the CPU: the layers that compute a GGUF file's blocks as they are stored.

``GgufCpuLinear`` (every linear layer) and ``GgufEmbedding`` (the embedding and the LM head, tied or not)
receive the file's block rows from the loader. A linear layer and the LM head then hold ``_Segment``s:
consecutive output rows of one type, decoded (``formats.gguf_blocks``) a few thousand rows at a time into
the int8 dot-product kernel's layout (``kernels.cpu_int8dot``) or into int4 planes for torch's kernel
(``kernels.cpu_int4pack``), else kept as a float weight; ``gguf_cache`` stores and maps them. The embedding
keeps the file's rows (a view of the mapped file) and decodes the rows a step looks up. ``GgufConfig``
(``pagoda_quant.methods.gguf``) chooses these methods where the CPU path applies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pagoda.errors import ModelLoadError

from pagoda_quant.formats.gguf_blocks import decode, to_planes
from pagoda_quant.kernels.cpu_int4pack import DEQUANT_ROWS, planes_linear
from pagoda_quant.kernels.cpu_int8dot import dot_linear
from pagoda_quant.methods.base import QuantizedLinearMethod, add_param, layer_name, replace_param

if TYPE_CHECKING:
    from pagoda_quant.methods.gguf import GgufConfig


class _Segment:
    """Consecutive output rows of one layer in one representation: a weight for the int8 dot-product
    kernel, int4 planes for torch's kernel, or a float weight."""

    def __init__(self, rows: int, planes=None, weight: torch.Tensor | None = None, dot=None):
        self.rows, self.planes, self.weight, self.dot = rows, planes, weight, dot

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dot is not None:  # (a decode step calls this a hundred times: no imports here)
            if x.numel() >= DEQUANT_ROWS * x.shape[-1]:  # a prefill chunk: widen once, the float GEMM
                return self.dot.prefill(x)
            return dot_linear(x, self.dot)
        return planes_linear(x, self.planes) if self.planes is not None else F.linear(x, self.weight.to(x.dtype))

    def widen(self) -> torch.Tensor:
        if self.dot is not None:
            return self.dot.widen()
        if self.planes is None:
            return self.weight.float()
        return sum(p.widen() for p in self.planes)

    def nbytes(self) -> int:
        if self.dot is not None:
            return self.dot.nbytes()
        if self.planes is None:
            return self.weight.numel() * self.weight.element_size()
        return sum(p.nbytes() for p in self.planes)


PACK_ROWS = 4096  # rows decoded and packed at a time: the transient codes stay a few MB


def _segments(pieces: list[tuple[torch.Tensor, str | None]], dtype: torch.dtype) -> list[_Segment]:
    """(rows, GGML type or None for float) per fused piece, in output order -> segments, pieces of one
    type merged (one kernel call for q, k and v when they share a type)."""
    from pagoda_quant.kernels import cpu_int8dot

    runs: list[list] = []
    for tensor, kind in pieces:
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(tensor)
        else:
            runs.append([kind, [tensor]])
    out = []
    for kind, tensors in runs:
        rows = sum(t.shape[0] for t in tensors)
        if kind is None:
            out.append(_Segment(rows, weight=torch.cat([t.to(dtype) for t in tensors])))
        elif cpu_int8dot.available():
            out.append(_Segment(rows, dot=_dot_weight(tensors, kind)))
        elif rows % 16:  # the packed layout works in blocks of 16 output rows
            out.append(_Segment(rows, weight=torch.cat([decode(t, kind).dequantize().to(dtype) for t in tensors])))
        else:
            out.append(_Segment(rows, planes=_packed_planes(tensors, kind)))
        for t in tensors:
            release_file_pages(t)
    return out


def _dot_weight(tensors: list[torch.Tensor], kind: str):
    """The rows of ``tensors`` (block rows of one type) in the int8 dot-product kernel's layout, decoded a
    few thousand rows at a time into preallocated tensors."""
    from pagoda_quant.kernels.cpu_int8dot import DotWeight

    chunks = [t[i:i + PACK_ROWS] for t in tensors for i in range(0, t.shape[0], PACK_ROWS)]
    if len(chunks) == 1:
        return DotWeight.from_codes(decode(chunks[0], kind))
    total = sum(c.shape[0] for c in chunks)
    whole, row = None, 0
    for c in chunks:  # float32 scales and offsets while filling; compacted once whole
        part = DotWeight.from_codes(decode(c, kind), compact=False)
        if whole is None:
            whole = DotWeight(part.layout, part.group, *(t.new_empty((total, *t.shape[1:])) for t in
                                                         (part.codes, part.scale, part.offset)))
        for dst, src in ((whole.codes, part.codes), (whole.scale, part.scale), (whole.offset, part.offset)):
            dst[row:row + part.n].copy_(src)
        row += part.n
    return whole.compact()


def _cached_segments(config: GgufConfig | None, name: str, pieces, dtype: torch.dtype) -> list[_Segment]:
    """A layer's segments from the packed-weight cache of this load (``gguf_cache``), else packed now
    (and remembered for the cache)."""
    cache = getattr(config, "packed_cache", None)
    segments = cache.get(name) if cache is not None else None
    if segments is None:
        segments = _segments(pieces, dtype)
        if cache is not None:
            cache.put(name, segments)
    return segments


def _packed_planes(tensors: list[torch.Tensor], kind: str):
    """Int4 planes of the rows of ``tensors`` (block rows of one type), decoded and packed a few
    thousand rows at a time into preallocated planes (no copy of the whole weight at any point)."""
    from pagoda_quant.kernels.cpu_int4pack import PackedPlane

    chunks = []
    for t in tensors:
        chunks += [t[i:i + PACK_ROWS] for i in range(0, t.shape[0], PACK_ROWS)]
    if any(c.shape[0] % 64 for c in chunks[:-1]):  # pieces of odd sizes: pack them as one
        chunks = [torch.cat(tensors)]
    if len(chunks) == 1:
        return [PackedPlane(p.codes, p.scale, p.zero) for p in to_planes(decode(chunks[0], kind))]
    total = sum(c.shape[0] for c in chunks)
    planes, row = None, 0
    for c in chunks:
        part = [PackedPlane(p.codes, p.scale, p.zero) for p in to_planes(decode(c, kind))]
        if planes is None:
            planes = [PackedPlane.empty_like(p, total) for p in part]
        for whole, piece in zip(planes, part):
            whole.write_rows(row, piece)
        row += c.shape[0]
        del part
    return planes


def release_file_pages(tensor: torch.Tensor) -> None:
    """Drop the mapped file's pages under ``tensor`` from this process's memory once decoded (the core
    loader's helper; nothing when the tensor is not a view of the file)."""
    try:
        from pagoda.loader.gguf_format import release_pages
    except ImportError:
        return
    release_pages(tensor)


def _gguf_kind(what: str, loaded: torch.Tensor) -> str | None:
    """The block type of a tensor from the GGUF loader (None: it arrives as floats)."""
    if not hasattr(loaded, "ggml_type"):
        raise ModelLoadError(f"quantization gguf: {what} received a {loaded.dtype} weight, not GGUF blocks: this "
                             f"setting applies to .gguf files; leave quantization unset for this model")
    return loaded.ggml_type if loaded.dtype == torch.uint8 else None


def _store_piece(layer, loaded: torch.Tensor, shard_id) -> None:
    kind = _gguf_kind(f"layer {layer_name(layer)}", loaded)
    index = 0 if shard_id is None else (shard_id if isinstance(shard_id, int) else layer.shard_names.index(shard_id))
    layer.gguf_pieces[index] = (loaded, kind)


def _native_parts(segments: list[_Segment]):
    from pagoda.kernels.cpu_decoder import NativeLinearPart

    parts = []
    for seg in segments:
        found = seg.dot.native() if seg.dot is not None else None
        if found is None:
            return None
        fn, weight, keep = found
        parts.append(NativeLinearPart(fn, weight, seg.rows, seg.dot.k, (seg.dot, keep)))
    return parts


class GgufCpuLinear(QuantizedLinearMethod):
    """A linear layer of a GGUF file on the CPU: its pieces arrive as block rows (``ggml_type`` set by
    the loader) or float tensors; after loading they become segments of packed planes."""

    method_name = "gguf-cpu"

    def __init__(self, config: GgufConfig | None = None):
        self.config = config

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        self.dtype = params_dtype
        layer.gguf_pieces = {}
        # a placeholder: the loader fills gguf_pieces, process_weights_after_loading builds the segments
        add_param(layer, "weight", (0,), torch.uint8, output_dim=None, input_dim=None,
                  weight_loader=lambda param, loaded, shard_id=None: _store_piece(layer, loaded, shard_id))

    def process_weights_after_loading(self, layer):
        pieces = layer.__dict__.pop("gguf_pieces")
        expected = len(layer.output_partition_sizes)
        if sorted(pieces) != list(range(expected)):
            raise ModelLoadError(f"quantization gguf: layer {layer_name(layer)} got pieces {sorted(pieces)} of "
                                 f"{expected}")
        ordered = [pieces[i] for i in range(expected)]
        for (t, kind), size in zip(ordered, layer.output_partition_sizes):
            if t.shape[0] != size:
                raise ModelLoadError(f"quantization gguf: layer {layer_name(layer)}: a {kind or 'float'} piece of "
                                     f"{t.shape[0]} rows where {size} are expected")
        layer.gguf_segments = _cached_segments(self.config, layer_name(layer), ordered, self.dtype)
        from pagoda_quant.kernels.cpu_int8dot import prefill_dtype

        prefill_dtype()  # a bad PAGODA_CPU_PREFILL_DTYPE fails the load, not a later step
        replace_param(layer, "weight", None)

    def apply(self, layer, x, bias):
        segs = layer.gguf_segments
        out = segs[0](x) if len(segs) == 1 else torch.cat([s(x) for s in segs], dim=-1)
        return out + bias if bias is not None else out

    def dequantize(self, layer):
        return torch.cat([s.widen() for s in layer.gguf_segments])

    def native_parts(self, layer):
        """The C functions of the layer's output columns (``QuantMethod.native_parts``): one per segment,
        where every segment is held for the int8 dot-product kernel; else None."""
        return _native_parts(layer.gguf_segments)

    def weight_bytes(self, layer):
        return sum(s.nbytes() for s in layer.gguf_segments)


class GgufEmbedding:
    """The embedding (and the LM head, tied or not) of a GGUF file on the CPU. The embedding keeps the
    file's block rows (a view of the mapped file) and decodes the rows a step looks up; the LM head
    packs them into int4 planes like a linear layer."""

    def __init__(self, dtype: torch.dtype, config: GgufConfig | None = None):
        self.dtype, self.config = dtype, config

    def load(self, module, loaded: torch.Tensor, shard_id=None) -> None:
        kind = _gguf_kind(f"layer {module.prefix}", loaded)
        expected = module.num_embeddings
        if loaded.shape[0] != expected:
            raise ModelLoadError(f"{module.prefix}.weight has {loaded.shape[0]} rows in the checkpoint, the model "
                                 f"expects {expected} (vocab_size)")
        module.gguf_rows = (loaded if kind is not None else loaded.to(self.dtype), kind)

    def process_weights_after_loading(self, module) -> None:
        source = getattr(module, "tied_to", None) or module
        rows, kind = source.gguf_rows
        if getattr(module, "is_lm_head", False):
            module.gguf_segments = _cached_segments(self.config, module.prefix, [(rows, kind)], self.dtype)
            if module is not source or kind is None:
                module.__dict__.pop("gguf_rows", None)

    def embed(self, module, input_ids: torch.Tensor) -> torch.Tensor:
        rows, kind = module.gguf_rows
        ids = input_ids.reshape(-1)
        if kind is None:
            return F.embedding(input_ids, rows)
        picked = rows.index_select(0, ids) if ids.numel() < rows.shape[0] else rows
        out = decode(picked, kind).dequantize().to(self.dtype)
        if ids.numel() >= rows.shape[0]:
            out = out.index_select(0, ids)
        return out.view(*input_ids.shape, -1)

    def weight_bytes(self, module) -> int:
        """Bytes held in memory (the embedding's rows are a view of the mapped file: none)."""
        return sum(s.nbytes() for s in getattr(module, "gguf_segments", ()))

    def apply(self, module, hidden: torch.Tensor, bias) -> torch.Tensor:
        segs = module.gguf_segments
        out = segs[0](hidden) if len(segs) == 1 else torch.cat([s(hidden) for s in segs], dim=-1)
        return out + bias if bias is not None else out
