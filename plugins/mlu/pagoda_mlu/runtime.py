"""Lazy access to Cambricon's PyTorch extension ``torch_mlu`` and its op library ``torch_mlu_ops``.

``import torch_mlu`` registers the ``mlu`` device with PyTorch and adds the ``torch.mlu``
namespace (``is_available``, ``device_count``, ``set_device``, ``mem_get_info``,
``synchronize``, ``empty_cache``, ``MLUGraph``, ...). Neither package is on PyPI; both ship
with Cambricon's SDK (see docs/mlu.md). Nothing here runs at plugin import.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

TORCH_MLU = "torch_mlu"
TORCH_MLU_OPS = "torch_mlu_ops"
SDK_HINT = ("it is Cambricon's PyTorch extension, installed from Cambricon's SDK or docker images, "
            "not from PyPI (see docs/mlu.md)")


def probe_torch_mlu() -> tuple[Any | None, str | None]:
    """``(torch.mlu, None)`` when torch_mlu imports and reports a device; else ``(None, reason)``."""
    try:
        import torch

        importlib.import_module(TORCH_MLU)
    except ImportError as exc:
        return None, f"{TORCH_MLU} is not importable ({exc}); {SDK_HINT}"
    except Exception as exc:  # a broken install: missing driver libraries, ABI mismatch
        return None, f"{TORCH_MLU} failed to import: {type(exc).__name__}: {exc}"
    mlu = getattr(torch, "mlu", None)
    if mlu is None:
        return None, f"{TORCH_MLU} imported but did not register torch.mlu"
    try:
        count = int(mlu.device_count()) if mlu.is_available() else 0
    except Exception as exc:
        return None, f"{TORCH_MLU} imported but torch.mlu.device_count() failed: {type(exc).__name__}: {exc}"
    if count < 1:
        return None, (f"{TORCH_MLU} imported but reports no MLU device (is the Cambricon driver loaded? "
                      f"`cnmon` lists the cards; MLU_VISIBLE_DEVICES may hide them)")
    return mlu, None


def torch_mlu_version() -> str:
    module = sys.modules.get(TORCH_MLU)
    return str(getattr(module, "__version__", "unknown")) if module is not None else "not imported"


def torch_mlu_ops_importable() -> bool:
    """Whether ``torch_mlu_ops`` can be imported, without importing it (cheap, for discovery)."""
    if TORCH_MLU_OPS in sys.modules:
        return sys.modules[TORCH_MLU_OPS] is not None
    try:
        return importlib.util.find_spec(TORCH_MLU_OPS) is not None
    except (ImportError, ValueError):
        return False


def load_torch_mlu_ops() -> Any:
    """The ``torch_mlu_ops`` module (Cambricon's fused LLM kernels); raises ImportError if absent."""
    importlib.import_module(TORCH_MLU)  # torch_mlu_ops' kernels run on torch_mlu's device
    return importlib.import_module(TORCH_MLU_OPS)
