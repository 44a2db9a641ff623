"""The core's own hook implementations: the CPU platform, the pure-torch attention
backends (multi-head and MLA), the default KV allocator and the torch reference of every
kernel op."""

from __future__ import annotations

from pagoda.hookspecs import hookimpl


@hookimpl
def register_platforms(register):
    from pagoda.platforms.cpu import CpuPlatform

    register(CpuPlatform())


@hookimpl
def register_attention_backends(register):
    from pagoda.attention.cpu_sdpa import CpuSdpaAttention
    from pagoda.attention.torch_mla import TorchMLAAttention
    from pagoda.attention.torch_paged import TorchPagedAttention

    register(TorchPagedAttention())
    register(CpuSdpaAttention())
    register(TorchMLAAttention())


@hookimpl
def register_allocators(register):
    from pagoda.allocator import DefaultKVAllocator

    register(DefaultKVAllocator())


@hookimpl
def register_kernels(register):
    from pagoda.kernels.reference import OPS

    for op in OPS:
        register(op, "*", f"pagoda.kernels.reference:{op}", priority=0)
