"""Entry point of pagoda-mlu (``[project.entry-points.pagoda] mlu = "pagoda_mlu.plugin"``).

Importing this module imports neither torch_mlu nor torch_mlu_ops: the platform probes
torch_mlu when asked whether it is available, and torch_mlu_ops kernels are registered as
lazy ``"module:function"`` strings only when the package can be found.
"""

from pagoda import hookimpl

from pagoda_mlu.runtime import torch_mlu_ops_importable

TMO_PRIORITY = 20  # above the core's torch reference (0) and any generic ("*") implementation
TMO_OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "store_kv_cache_head_major", "fused_moe")


@hookimpl
def register_platforms(register):
    from pagoda_mlu.platform import MluPlatform

    register(MluPlatform())


@hookimpl
def register_attention_backends(register):
    from pagoda_mlu.chunked_attention import MluChunkedAttention
    from pagoda_mlu.fused_attention import MluFusedAttention

    register(MluChunkedAttention())
    register(MluFusedAttention())


@hookimpl
def register_allocators(register):
    from pagoda_mlu.allocator import MluKVAllocator

    register(MluKVAllocator())


@hookimpl
def register_kernels(register):
    # The MLU cache layout's write op, in torch: the floor on every platform.
    register("store_kv_cache_head_major", "*", "pagoda_mlu.paged_cache:store_kv_cache_head_major", priority=0)
    if torch_mlu_ops_importable():
        for op in TMO_OPS:
            register(op, "mlu", f"pagoda_mlu.tmo_kernels:{op}", priority=TMO_PRIORITY)
