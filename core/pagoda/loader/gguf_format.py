"""A GGUF file's metadata and tensor index, read in one pass over the header.

``gguf.GGUFReader`` builds a numpy view per element of every metadata array, so a tokenizer's
vocabulary and merges (about 100,000 strings in SmolLM2's file) take it seconds. This reader
walks the header with ``struct`` over one memory map (GGUF v2/v3, little-endian), decodes
numeric arrays with ``numpy.frombuffer``, and leaves tensor data as lazy views of the map.
The gguf package still provides the quantization types and the dequantization.

Layout: magic, version, tensor count, metadata count; metadata (key, value type, value;
arrays are an item type, a count and the items; strings a uint64 length and UTF-8 bytes);
tensor infos (name, dimensions fastest-varying first, type, offset); then the data, aligned to
``general.alignment`` (32 by default), each tensor at its offset from the data's start.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
STRING, ARRAY = 8, 9
# GGUF value type -> struct format of one value
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# element dtypes of unquantized tensor types (GGML type name -> numpy dtype); others are uint8 blocks
PLAIN_TENSOR_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                      "I32": np.int32, "I64": np.int64}


class GGUFFormatError(ValueError):
    pass


@dataclass
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    data: np.ndarray  # reversed shape in the element dtype, or uint8 rows of quantized blocks


_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buf, raw=None) -> None:
        self.buf, self.pos = buf, 0
        self.raw = raw if raw is not None else buf  # slicing an mmap gives bytes directly

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary: ~100,000 of them), in one tight loop."""
        raw, unpack, pos, out = self.raw, _U64.unpack_from, self.pos, []
        append = out.append
        try:
            for _ in range(count):
                (n,) = unpack(raw, pos)
                append(raw[pos + 8:pos + 8 + n].decode("utf-8"))
                pos += 8 + n
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"a string at byte {pos} is not UTF-8: {exc}") from exc
        self.pos = pos
        return out

    def unpack(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.unpack("Q")
        try:
            text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"a string at byte {self.pos} is not UTF-8: {exc}") from exc
        self.pos += n
        return text

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.unpack("IQ")
            if item == STRING:
                return self.strings(count)
            if item not in SCALARS:
                raise GGUFFormatError(f"unsupported array item type {item}")
            fmt = SCALARS[item]
            dtype = np.dtype("<" + fmt) if fmt != "?" else np.dtype(np.bool_)
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
            self.pos += dtype.itemsize * count
            return values
        if kind not in SCALARS:
            raise GGUFFormatError(f"unsupported value type {kind}")
        return self.unpack(SCALARS[kind])


def release_pages(tensor) -> None:
    """Tell the kernel this process no longer needs the pages of the mapped file under ``tensor`` (a
    read-only view from ``read_gguf``): they leave its resident memory and are read again from the page
    cache if touched. Nothing for tensors that own their memory, or where madvise is missing."""
    base = getattr(tensor, "_gguf_mapped", None)
    if base is None:
        return
    import ctypes

    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // page) * page, end // page * page
    if last <= first:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 4)  # MADV_DONTNEED
    except (OSError, AttributeError):
        pass


def read_gguf(path: str | Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """(metadata key -> value, tensors in file order) of a GGUF file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(memoryview(buf), buf)
    if bytes(cur.buf[:4]) != MAGIC:
        raise GGUFFormatError("no GGUF magic at the start of the file")
    cur.pos = 4
    version, num_tensors, num_fields = cur.unpack("IQQ")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} (or a big-endian file) is not supported (versions 2 and 3)")
    fields: dict[str, Any] = {}
    for _ in range(num_fields):
        key = cur.string()
        fields[key] = cur.value(cur.unpack("I"))
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = cur.unpack("I")
        shape = tuple(cur.unpack("Q") for _ in range(dims))
        kind, offset = cur.unpack("IQ")
        infos.append((name, shape, GGMLQuantizationType(kind), offset))
    align = int(fields.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    data = np.frombuffer(buf, dtype=np.uint8)
    tensors = []
    for name, shape, kind, offset in infos:
        block, type_size = GGML_QUANT_SIZES[kind]
        count = int(np.prod(shape, dtype=np.int64))
        raw = data[start + offset:start + offset + count * type_size // block]
        np_shape = tuple(reversed(shape))
        plain = PLAIN_TENSOR_TYPES.get(kind.name)
        array = raw.view(plain).reshape(np_shape) if plain else raw.reshape(quant_shape_to_byte_shape(np_shape, kind))
        tensors.append(GGUFTensor(name, kind, shape, array))
    return fields, tensors
