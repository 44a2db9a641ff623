"""The CUDA platform: device queries, NCCL, bf16 by default, and CUDA graph capture.

torch is imported inside the methods, so registering the platform costs nothing and a
machine without CUDA gets a reason instead of an import error.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from pagoda.interfaces import CapturedGraph, Platform

logger = logging.getLogger("pagoda")


class CudaGraph(CapturedGraph):
    """One captured ``torch.cuda.CUDAGraph``; ``output`` is what the captured function
    returned, living in the graph's memory pool and rewritten by every ``replay()``."""

    def __init__(self, graph: Any, output: Any):
        self.graph = graph
        self.output = output

    def replay(self) -> None:
        self.graph.replay()


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    priority = 10  # above the CPU: device "auto" takes a GPU when one is usable
    dist_backend = "nccl"
    default_dtype = "bfloat16"
    supports_graphs = True
    supports_async_steps = True  # kernels and copies queue on the stream; events mark them
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    def unavailable_reason(self) -> str | None:
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - torch is a core dependency
            return f"torch cannot be imported: {exc}"
        if torch.version.cuda is None:
            return (f"the installed torch {torch.__version__} was built without CUDA "
                    f"(install a CUDA build of torch)")
        if not torch.cuda.is_available():
            import os

            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            return f"torch {torch.__version__} sees no CUDA device{hint}: no GPU, or no working driver"
        return None

    def dtype_unsupported_reason(self, dtype: str) -> str | None:
        if dtype != "bfloat16" or self.unavailable_reason() is not None:
            return None
        import torch

        major, minor = torch.cuda.get_device_capability()
        if major < 8:
            return (f"bfloat16 needs compute capability 8.0 or newer; this GPU has {major}.{minor} "
                    f"(use dtype float16)")
        return None

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count()

    def set_device(self, index: int) -> None:
        """Take GPU ``index``, and leave torch one CPU thread unless ``OMP_NUM_THREADS`` says otherwise: the
        engine's host tensors are small, and torch's idle OpenMP threads spin on the cores the grammar
        library's mask fill and the server need (64 xgrammar masks took 4.5 ms with torch's 16 threads
        against 0.8 ms with one, on the H200 machine's 16 cores: docs/benchmarks.md). vLLM does the same."""
        import torch

        from pagoda_cuda import switches

        switches.check()  # a malformed kernel switch stops the engine here, named, not as a kernel import failure
        torch.cuda.set_device(index)
        if not os.environ.get("OMP_NUM_THREADS", "").strip() and torch.get_num_threads() != 1:
            logger.info("torch CPU threads: 1 (was %d; set OMP_NUM_THREADS to choose)", torch.get_num_threads())
            torch.set_num_threads(1)

    def memory_info(self) -> tuple[int, int]:
        import torch

        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)

    def default_max_num_batched_tokens(self) -> int:
        """16384 tokens per step on devices of at least 70 GiB (H100/H200 class), else 8192. An
        eager prefill step costs the host about the same launch time whatever its size, and at
        8192 tokens a small model's step is host-bound (Qwen3-0.6B on an H200: about 16 ms of
        kernels in a 25-40 ms step); vLLM's offline default on these devices is also 16384."""
        import torch

        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return 16384 if total >= 70 * (1 << 30) else 8192

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        import torch

        torch.cuda.empty_cache()

    def host_buffer(self, shape: tuple[int, ...], dtype) -> Any:
        """Page-locked: a copy from pageable memory may wait for all the work queued before it."""
        import torch

        return torch.zeros(shape, dtype=dtype, pin_memory=True)

    def pin(self, host) -> Any:
        return host.pin_memory()  # (the caching host allocator recycles these buffers)

    def pin_in_place(self, host) -> Callable[[], None] | None:
        """Through the driver (``cuMemHostRegister``), which reports a failure by its return value only: the
        runtime's ``cudaHostRegister`` would leave its error behind for torch's next launch check."""
        import torch

        driver = _driver()
        ptr, size = host.data_ptr(), host.numel() * host.element_size()
        if driver is None or size == 0:
            return None
        torch.cuda.current_stream().query()  # (a runtime call: the device's context current on this thread)
        code = driver.cuMemHostRegister_v2(ctypes.c_void_p(ptr), ctypes.c_size_t(size), ctypes.c_uint(0))
        if code != 0:
            logger.debug("cuMemHostRegister failed (%d): host rows are copied through pinned buffers", code)
            return None
        return lambda: driver.cuMemHostUnregister(ctypes.c_void_p(ptr))

    def record_event(self, timing: bool = False) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=timing)
        event.record()
        return event

    def graph_pool(self) -> Any:
        """A new memory pool. One engine captures all its decode buckets into one pool (largest
        first, so smaller ones reuse its memory); a later engine in the same process gets its
        own, since reusing a pool whose graphs were freed trips the caching allocator's
        assertion (seen on an H200 when a second engine captured)."""
        import torch

        return torch.cuda.graph_pool_handle()

    def capture_graph(self, fn: Callable[[], Any], pool: Any = None) -> CudaGraph:
        """Capture ``fn`` (already run once or twice by the caller, so lazy initialisation
        and kernel compilation happened outside the capture)."""
        import torch

        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=pool if pool is not None else self.graph_pool()):
            output = fn()
        torch.cuda.synchronize()
        return CudaGraph(graph, output)

    def describe(self) -> str:
        reason = self.unavailable_reason()
        if reason is not None:
            return f"cuda (unavailable: {reason})"
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return (f"cuda: {props.name} ({props.multi_processor_count} SMs, "
                f"{props.total_memory / (1 << 30):.0f} GiB, compute capability {props.major}.{props.minor}; "
                f"{torch.cuda.device_count()} device(s))")


@functools.cache
def _driver() -> ctypes.CDLL | None:
    """The CUDA driver library the process already uses (None where it cannot be loaded)."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
