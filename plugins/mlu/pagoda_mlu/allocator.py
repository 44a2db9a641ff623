"""The MLU KV allocator: size the cache from MLU free memory and the budget, then reserve the
whole cache as one allocation so that torch_mlu's caching allocator cannot fragment it mid-run.

Sizing (``plan_kv_pool``), in this order, as in the core's default allocator:
  1. ``num_kv_blocks`` if set: exactly that many blocks;
  2. ``kv_cache_memory_gb`` if set: that many GiB, rounded down to whole blocks;
  3. otherwise ``free - (1 - memory_utilization) * total`` bytes, where (free, total) come from
     ``torch.mlu.mem_get_info()`` measured after ``torch.mlu.empty_cache()``: memory the caching
     allocator holds but no tensor uses (left over from loading weights) counts as free.
The pool is one tensor of ``num_blocks * bytes_per_block`` bytes; each layer's cache is a view
of it, so the cache never competes with activations for fragments of device memory.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from pagoda.errors import ConfigError
from pagoda.interfaces import KVAllocator, Platform

logger = logging.getLogger("pagoda")
GiB = 1 << 30


@dataclass(frozen=True)
class KVPoolPlan:
    num_blocks: int
    bytes_per_block: int
    budget_bytes: int  # what the configuration allows the cache (before rounding to blocks)
    source: str  # which setting decided: num_kv_blocks, kv_cache_memory_gb or memory_utilization

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def plan_kv_pool(free_bytes: int, total_bytes: int, bytes_per_block: int, config,
                 device_name: str = "mlu") -> KVPoolPlan:
    """The number of KV blocks for a device with ``free_bytes`` of ``total_bytes`` free."""
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    if config.num_kv_blocks:
        n = int(config.num_kv_blocks)
        return KVPoolPlan(n, bytes_per_block, n * bytes_per_block, "num_kv_blocks")
    if config.kv_cache_memory_gb:
        budget = int(config.kv_cache_memory_gb * GiB)
        source = "kv_cache_memory_gb"
    else:
        budget = int(free_bytes - (1.0 - config.memory_utilization) * total_bytes)
        source = "memory_utilization"
    blocks = budget // bytes_per_block if budget > 0 else 0
    if blocks < 1:
        raise ConfigError(
            f"no memory left for the KV cache on {device_name}: {source} allows {budget / GiB:.2f} GiB "
            f"(device free {free_bytes / GiB:.2f} of {total_bytes / GiB:.2f} GiB) and one block takes "
            f"{bytes_per_block} bytes; raise memory_utilization or set kv_cache_memory_gb / num_kv_blocks")
    return KVPoolPlan(int(blocks), bytes_per_block, budget, source)


class MluKVAllocator(KVAllocator):
    name = "mlu-pool"
    priority = 10  # above the core's default allocator (priority 0) on the mlu platform
    platforms = ("mlu",)

    def plan(self, platform: Platform, bytes_per_block: int, config) -> KVPoolPlan:
        if config.num_kv_blocks or config.kv_cache_memory_gb:
            free = total = 0  # not needed: the configuration fixes the size
        else:
            platform.empty_cache()  # hand cached-but-unused memory back so mem_get_info counts it
            free, total = platform.memory_info()
        plan = plan_kv_pool(free, total, bytes_per_block, config, platform.name)
        logger.info("KV pool on %s: %d blocks x %d bytes = %.2f GiB (%s)", platform.name, plan.num_blocks,
                    bytes_per_block, plan.pool_bytes / GiB, plan.source)
        return plan

    def num_blocks(self, platform: Platform, bytes_per_block: int, config) -> int:
        return self.plan(platform, bytes_per_block, config).num_blocks

    def allocate(self, shapes: list[tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device) -> list[torch.Tensor]:
        """One allocation holding every layer's cache back to back; returns per-layer views."""
        numels = [math.prod(shape) for shape in shapes]
        # Zeroed on the device so padding slots read finite values; on the CPU (tests) zeroing
        # a large pool costs page faults and nothing reads a slot before it is written.
        make = torch.empty if torch.device(device).type == "cpu" else torch.zeros
        pool = make(sum(numels), dtype=dtype, device=device)
        views, offset = [], 0
        for shape, numel in zip(shapes, numels):
            views.append(pool[offset:offset + numel].view(shape))
            offset += numel
        return views
