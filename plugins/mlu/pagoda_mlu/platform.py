"""The Cambricon MLU platform: device ``mlu`` through ``torch_mlu``'s ``torch.mlu`` namespace."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagoda.errors import PluginError
from pagoda.interfaces import CapturedGraph, Platform

from pagoda_mlu.runtime import TORCH_MLU, probe_torch_mlu, torch_mlu_version


class MluCapturedGraph(CapturedGraph):
    def __init__(self, graph: Any, output: Any):
        self.graph = graph
        self.output = output

    def replay(self) -> None:
        self.graph.replay()


class MluPlatform(Platform):
    """Available when ``torch_mlu`` imports and reports at least one MLU.

    float16 is the default dtype (every MLU computes in it); bfloat16 is accepted where
    ``torch.mlu.is_bf16_supported()`` says so. Decode graphs use ``torch.mlu.MLUGraph``
    where this torch_mlu has it, and the engine runs eagerly otherwise.
    """

    name = "mlu"
    device_type = "mlu"
    priority = 20  # above cpu: a machine with a working MLU uses it under device: auto
    dist_backend = "cncl"  # Cambricon's collective library, registered with torch.distributed by torch_mlu
    visible_devices_env = "MLU_VISIBLE_DEVICES"  # (Cambricon's CUDA_VISIBLE_DEVICES)
    default_dtype = "float16"
    env_switch = "PAGODA_USE_CAMB"

    def __init__(self) -> None:
        self._probed = False
        self._mlu: Any = None
        self._reason: str | None = None

    # ------------------------------------------------------------------ availability
    def _probe(self) -> None:
        if not self._probed:
            self._mlu, self._reason = probe_torch_mlu()
            self._probed = True

    def unavailable_reason(self) -> str | None:
        self._probe()
        return self._reason

    @property
    def mlu(self) -> Any:
        """``torch.mlu``; a PluginError naming torch_mlu when it is unusable here."""
        self._probe()
        if self._mlu is None:
            raise PluginError(f"the mlu platform is unavailable: {self._reason}")
        return self._mlu

    # ------------------------------------------------------------------ device
    def device_count(self) -> int:
        return int(self.mlu.device_count())

    def set_device(self, index: int) -> None:
        self.mlu.set_device(index)

    def memory_info(self) -> tuple[int, int]:
        free, total = self.mlu.mem_get_info()  # cnrtMemGetInfo of the current device
        return int(free), int(total)

    def synchronize(self) -> None:
        self.mlu.synchronize()

    def empty_cache(self) -> None:
        self.mlu.empty_cache()

    def dtype_unsupported_reason(self, dtype: str) -> str | None:
        if dtype != "bfloat16":
            return None
        check = getattr(self.mlu, "is_bf16_supported", None)
        if check is not None and not check():
            return "torch.mlu.is_bf16_supported() is False on this MLU; use float16"
        return None

    # ------------------------------------------------------------------ graphs
    @property
    def supports_graphs(self) -> bool:  # type: ignore[override]
        if self.unavailable_reason() is not None:
            return False
        return all(hasattr(self._mlu, attr) for attr in ("MLUGraph", "graph", "graph_pool_handle"))

    def capture_graph(self, fn: Callable[[], Any], pool: Any = None) -> CapturedGraph:
        if not self.supports_graphs:
            raise NotImplementedError(f"this {TORCH_MLU} has no torch.mlu.MLUGraph")
        graph = self.mlu.MLUGraph()
        with self.mlu.graph(graph, pool=pool):
            output = fn()
        return MluCapturedGraph(graph, output)

    def graph_pool(self) -> Any:
        return self.mlu.graph_pool_handle() if self.supports_graphs else None

    def describe(self) -> str:
        if self.unavailable_reason() is not None:
            return "mlu (unavailable)"
        return f"mlu ({self.device_count()} device(s), {TORCH_MLU} {torch_mlu_version()})"
