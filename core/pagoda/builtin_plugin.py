"""The core's own hook implementations: the CPU platform, the pure-torch attention
backends (multi-head and MLA), the default KV allocator, the torch reference of every
kernel op and the transformers fallback for architectures no plugin implements."""

from __future__ import annotations

from pagoda.hookspecs import hookimpl


@hookimpl
def register_platforms(register):
    from pagoda.platforms.cpu import CpuPlatform

    register(CpuPlatform())


@hookimpl
def register_attention_backends(register):
    from pagoda.attention.torch_mla import TorchMLAAttention
    from pagoda.attention.torch_paged import TorchPagedAttention

    register(TorchPagedAttention())
    register(TorchMLAAttention())


@hookimpl
def register_models(register):
    from pagoda.registry import MODEL_FALLBACK

    register(MODEL_FALLBACK, "pagoda.transformers_fallback.model:TransformersForCausalLM")


@hookimpl
def register_allocators(register):
    from pagoda.allocator import DefaultKVAllocator

    register(DefaultKVAllocator())


@hookimpl
def register_kernels(register):
    from pagoda.kernels.reference import OPS

    for op in OPS:
        register(op, "*", f"pagoda.kernels.reference:{op}", priority=0)
