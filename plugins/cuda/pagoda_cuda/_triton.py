"""Small helpers shared by the Triton kernels (imports triton)."""

from __future__ import annotations

import os

import triton


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (CPU tests): kernels upcast to float32 before any
    arithmetic there, since the interpreter computes wrongly on bf16 values."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def patch_interpreter_for_numpy2() -> None:
    """Triton 3.6's interpreter turns scalar tensors into ints with ``int(array)``, which
    NumPy >= 2.4 refuses for its 1-element arrays: every ``range`` over a runtime bound
    then fails. Use ``.item()`` instead (interpreter only; compiled kernels are unaffected)."""
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
    patch_interpreter_for_numpy2()


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


_SM_COUNT: dict[int, int] = {}


def sm_count(device) -> int:
    """Multiprocessors of a CUDA device (132 on an H200); a nominal 132 elsewhere."""
    import torch

    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]
