"""Triton helpers shared by pagoda-quant's kernels (imports triton)."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (CPU tests). Kernels then multiply in float32: the
    interpreter computes wrongly on bf16 values (the products are the same, since a product of
    two bf16/fp16 values is exact in float32)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _patch_interpreter_for_numpy2() -> None:
    """Triton 3.6's interpreter converts a scalar kernel argument to an int with
    ``int(array)``, which NumPy >= 2.4 refuses for 1-element arrays, so a ``range`` over a
    runtime bound fails. Read the element instead (interpreter only; compiled kernels are
    unaffected). The flag is shared with other plugins that apply the same fix."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_pagoda_index_patch", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._pagoda_index_patch = True


if interpreting():
    _patch_interpreter_for_numpy2()
