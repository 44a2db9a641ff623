"""The CPU platform: always available, float32 by default, no graphs."""

from __future__ import annotations

import os

from pagoda.interfaces import Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    priority = 0
    dist_backend = "gloo"
    default_dtype = "float32"
    supports_graphs = False
    # Without an explicit size, the CPU cache takes at most this much of the free memory.
    max_default_kv_cache_bytes = 1 << 30

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
        return f"cpu ({os.cpu_count()} cores)"
