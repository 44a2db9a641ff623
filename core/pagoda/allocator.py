"""The default KV allocator: sizes the cache from the memory budget and allocates zeros."""

from __future__ import annotations

import torch

from pagoda.errors import ConfigError
from pagoda.interfaces import KVAllocator, Platform

GiB = 1 << 30


class DefaultKVAllocator(KVAllocator):
    """``num_kv_blocks`` if set; else ``kv_cache_memory_gb``; else what remains of
    ``memory_utilization`` × device memory once the weights are loaded (the runner calls
    this once the weights are loaded). Activations are not measured: the part of device memory
    outside ``memory_utilization`` is what they and the graphs live in."""

    name = "default"
    priority = 0
    platforms = ("*",)

    def budget_bytes(self, platform: Platform, config) -> int:
        if config.kv_cache_memory_gb:
            return int(config.kv_cache_memory_gb * GiB)
        free, total = platform.memory_info()
        budget = int(free - (1.0 - config.memory_utilization) * total)
        cap = platform.max_default_kv_cache_bytes
        return min(budget, cap) if cap else budget

    def num_blocks(self, platform: Platform, bytes_per_block: int, config) -> int:
        if config.num_kv_blocks:
            return config.num_kv_blocks
        budget = self.budget_bytes(platform, config)
        blocks = budget // bytes_per_block if budget > 0 else 0
        if blocks < 1:
            raise ConfigError(
                f"no memory left for the KV cache on {platform.name} (budget {budget / GiB:.2f} GiB, "
                f"{bytes_per_block} bytes per block): raise memory_utilization or set "
                f"kv_cache_memory_gb / num_kv_blocks")
        return int(blocks)

    def allocate(self, shapes, dtype, device):
        # Zeroed on devices (padding reads stay finite); on the CPU zeroing a large cache costs
        # seconds of page faults, and the CPU backends never read a slot before writing it.
        make = torch.empty if torch.device(device).type == "cpu" else torch.zeros
        return [make(shape, dtype=dtype, device=device) for shape in shapes]
