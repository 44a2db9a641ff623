"""Triton helpers shared by pagoda-quant's kernels: the core's interpreter support (kernels
multiply in float32 under the interpreter, which computes wrongly on bf16 values; the products are
the same, since a product of two bf16/fp16 values is exact in float32)."""

from __future__ import annotations

from pagoda.kernels.triton_support import interpreting, prepare_interpreter

__all__ = ["interpreting"]

prepare_interpreter()
