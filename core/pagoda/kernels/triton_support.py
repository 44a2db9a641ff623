"""Helpers for plugins that write Triton kernels (imports triton only when called).

Every Triton plugin needs the same two things on a CPU test machine: to know whether kernels
run in the interpreter (``TRITON_INTERPRET=1``), where arithmetic on bf16 values is wrong so
kernels upcast to float32 first, and a fix for Triton 3.6's interpreter under NumPy >= 2.4.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def patch_interpreter_for_numpy2() -> None:
    """Triton 3.6's interpreter turns scalar tensors into ints with ``int(array)``, which NumPy
    >= 2.4 refuses for its 1-element arrays: every ``range`` over a runtime bound then fails.
    Read the element instead (interpreter only; compiled kernels are unaffected). Idempotent."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_pagoda_index_patch", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._pagoda_index_patch = True


def prepare_interpreter() -> None:
    """Call at the import of a kernel module: applies the interpreter fix when interpreting."""
    if interpreting():
        patch_interpreter_for_numpy2()
