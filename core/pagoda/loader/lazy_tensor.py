"""A safetensors tensor that is read only when (and as far as) a weight loader needs it.

Under tensor or expert parallelism every rank streams the whole checkpoint but keeps a
slice: ``LazyTensor`` wraps ``safe_open(...).get_slice(name)`` so that ``narrow``,
indexing with ints/slices and ``chunk`` only narrow the window, and the bytes are read
when the loader finally copies (``param.copy_(loaded)``) — just the rank's slice. An expert
that lives on another rank is never read at all.

Anything else a loader does (``torch.split``, ``.float()``, arithmetic, ...) reads the
current window and runs on the real tensor (through ``__torch_function__`` and attribute
fallback), so loaders written for plain tensors keep working unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class LazyTensor:
    """A window ``[start, stop)`` per dimension of a stored tensor; int-indexed dims are dropped."""

    def __init__(self, source: Any, ranges: list[tuple[int, int]] | None = None,
                 kept: list[bool] | None = None):
        self._source = source  # safetensors PySafeSlice: get_shape(), get_dtype(), [slices]
        full = list(source.get_shape())
        self._ranges = ranges if ranges is not None else [(0, n) for n in full]
        self._kept = kept if kept is not None else [True] * len(full)
        self._value: torch.Tensor | None = None

    # ------------------------------------------------------------------ metadata, no read
    @property
    def shape(self) -> torch.Size:
        return torch.Size(b - a for (a, b), k in zip(self._ranges, self._kept) if k)

    @property
    def dtype(self) -> torch.dtype:
        return SAFETENSORS_DTYPES[self._source.get_dtype()]

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def dim(self) -> int:
        return len(self.shape)

    ndim = property(dim)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    # ------------------------------------------------------------------ narrowing, no read
    def _stored_dim(self, dim: int) -> int:
        """The stored dimension behind visible dimension ``dim``."""
        visible = [i for i, k in enumerate(self._kept) if k]
        return visible[dim]

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        dim = dim % self.dim()
        stored = self._stored_dim(dim)
        a, b = self._ranges[stored]
        if start < 0 or start + length > b - a:
            raise IndexError(f"narrow({dim}, {start}, {length}) is outside a dimension of size {b - a}")
        ranges = list(self._ranges)
        ranges[stored] = (a + start, a + start + length)
        return LazyTensor(self._source, ranges, list(self._kept))

    def __getitem__(self, key: Any) -> Any:
        keys = key if isinstance(key, tuple) else (key,)
        if not all(isinstance(k, int) or (isinstance(k, slice) and k.step in (None, 1)) for k in keys) \
                or len(keys) > self.dim():
            return self._read()[key]
        out, kept = self, list(self._kept)
        for dim, k in reversed(list(enumerate(keys))):  # from the last so earlier dims keep their index
            size = out.shape[dim]
            if isinstance(k, int):
                index = k + size if k < 0 else k
                if not 0 <= index < size:
                    raise IndexError(f"index {k} is out of range for a dimension of size {size}")
                out = out.narrow(dim, index, 1)
                kept = list(out._kept)
                kept[out._stored_dim(dim)] = False
                out = LazyTensor(self._source, out._ranges, kept)
            else:
                start, stop, _ = k.indices(size)
                out = out.narrow(dim, start, max(0, stop - start))
        return out

    def chunk(self, chunks: int, dim: int = 0) -> tuple[LazyTensor, ...]:
        size = self.shape[dim]
        step = -(-size // chunks)
        return tuple(self.narrow(dim, s, min(step, size - s)) for s in range(0, size, step))

    # ------------------------------------------------------------------ reading
    def _read(self) -> torch.Tensor:
        if self._value is None:
            window = self._source[tuple(slice(a, b) for a, b in self._ranges)]
            self._value = window.reshape(self.shape)
        return self._value

    def materialize(self) -> torch.Tensor:
        return self._read()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(x):
            return x._read() if isinstance(x, LazyTensor) else x

        return func(*tree_map(real, tuple(args)), **tree_map(real, dict(kwargs or {})))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._read(), name)

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None):
        return self._read().numpy() if dtype is None else self._read().numpy().astype(dtype)


def _delegate(name: str):
    def op(self, *args):
        return getattr(self._read(), name)(*args)

    op.__name__ = name
    return op


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
              "__rtruediv__", "__neg__", "__pow__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
              "__and__", "__or__", "__invert__", "__float__", "__int__", "__bool__", "__iter__"):
    setattr(LazyTensor, _name, _delegate(_name))
