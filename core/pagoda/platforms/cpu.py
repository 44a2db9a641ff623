"""The CPU platform: always available, float32 by default, no graphs.

Threads: torch computes with ``OMP_NUM_THREADS`` threads when that is set; otherwise with one per core
this process may use (its CPU affinity, e.g. a container's cpuset or ``taskset``), chosen when the
engine takes the device. Step budget: while sequences decode, a step computes at most as many prompt
tokens as keep it near ``STALL_SECONDS`` (``step_token_budget``), so a long prompt arriving does not
freeze running streams; see docs/cpu.md.
"""

from __future__ import annotations

import os

from pagoda.interfaces import Platform

# what one step may take while streams decode
STALL_SECONDS = 1.0
# effective matmul rate of one thread (packed int4 and float32 kernels on an AVX2 core, measured on the
# project's 2-core machine: docs/cpu.md); a step's FLOPs at this rate make its time
FLOPS_PER_THREAD = 2.0e10


def usable_cores() -> int:
    """Cores this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def thread_choice() -> tuple[int, str]:
    """(threads, why): ``OMP_NUM_THREADS`` if set, else the usable cores."""
    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    if raw:
        try:
            return max(1, int(raw)), "OMP_NUM_THREADS"
        except ValueError:
            pass
    return usable_cores(), "one per core this process may use; set OMP_NUM_THREADS to change"


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    priority = 0
    dist_backend = "gloo"
    default_dtype = "float32"
    supports_graphs = False
    # Without an explicit size, the CPU cache takes at most this much of the free memory.
    max_default_kv_cache_bytes = 1 << 30
    threads: int | None = None
    threads_reason = ""

    def set_device(self, index: int) -> None:
        """The engine takes the CPU: set torch's thread count (see the module docstring)."""
        import torch

        threads, why = thread_choice()
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.threads, self.threads_reason = threads, why

    def step_token_budget(self, flops_per_token: float) -> int | None:
        import torch

        rate = FLOPS_PER_THREAD * torch.get_num_threads()
        tokens = int(STALL_SECONDS * rate / max(flops_per_token, 1.0))
        return max(16, tokens // 16 * 16)

    def memory_info(self) -> tuple[int, int]:
        info = {}
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    info[key] = int(rest.split()[0]) * 1024
        except OSError:
            pass
        total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        free = info.get("MemAvailable", total // 2)
        return free, total

    def describe(self) -> str:
        threads = f", {self.threads} threads" if self.threads else ""
        return f"cpu ({usable_cores()} usable of {os.cpu_count()} cores{threads})"
