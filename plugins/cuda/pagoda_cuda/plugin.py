"""Entry point of pagoda-cuda: the CUDA platform, Triton attention and Triton kernel ops.

Nothing heavy is imported here: kernels are registered as ``"module:function"`` strings
(imported when an engine on the CUDA platform first asks for the op), and the platform and
backend objects import torch/triton inside their methods.
"""

from __future__ import annotations

from pagoda import hookimpl

# op name -> implementation, for the "cuda" platform (signatures: pagoda.kernels.reference)
KERNELS = {
    "linear": "pagoda_cuda.ops.linear:linear",
    "rms_norm": "pagoda_cuda.ops.norm:rms_norm",
    "fused_add_rms_norm": "pagoda_cuda.ops.norm:fused_add_rms_norm",
    "rms_norm_offset": "pagoda_cuda.ops.norm:rms_norm_offset",
    "fused_add_rms_norm_offset": "pagoda_cuda.ops.norm:fused_add_rms_norm_offset",
    "rotary_embedding": "pagoda_cuda.ops.rotary:rotary_embedding",
    "qk_norm_rotary": "pagoda_cuda.ops.rotary:qk_norm_rotary",
    "silu_and_mul": "pagoda_cuda.ops.activation:silu_and_mul",
    "gelu_tanh_and_mul": "pagoda_cuda.ops.activation:gelu_tanh_and_mul",
    "store_kv_cache": "pagoda_cuda.ops.kv_store:store_kv_cache",
    "store_mla_cache": "pagoda_cuda.attention.mla_decode:store_mla_cache",
    "fused_moe": "pagoda_cuda.ops.moe:fused_moe",
    "topk_softmax": "pagoda_cuda.ops.moe_routing:topk_softmax",
    "lora_shrink": "pagoda_cuda.ops.lora:lora_shrink",
    "lora_expand": "pagoda_cuda.ops.lora:lora_expand",
    "lora_fused": "pagoda_cuda.ops.lora:lora_fused",
    "lora_expand_stacked": "pagoda_cuda.ops.lora:lora_expand_stacked",
    "apply_token_bitmask": "pagoda_cuda.ops.grammar:apply_token_bitmask",
    # pagoda-quant's ops (its formats; references in pagoda_quant.kernels.reference): used only when
    # pagoda-quant's methods run, so pagoda-quant need not be installed for the rest
    "fp8_linear": "pagoda_cuda.quant.dispatch:fp8_linear",
    "fp8_block_linear": "pagoda_cuda.quant.dispatch:fp8_block_linear",
    "int4_linear": "pagoda_cuda.quant.dispatch:int4_linear",
    "fused_moe_quant": "pagoda_cuda.quant.dispatch:fused_moe_quant",
}
KERNEL_PRIORITY = 10


@hookimpl
def register_platforms(register):
    from pagoda_cuda.platform import CudaPlatform

    register(CudaPlatform())


@hookimpl
def register_attention_backends(register):
    from pagoda_cuda.attention.backend import TritonPagedAttention
    from pagoda_cuda.attention.mla_backend import TritonMLAAttention
    from pagoda_cuda.attention.sparse_mla_backend import TritonSparseMLAAttention

    register(TritonPagedAttention())
    register(TritonMLAAttention())
    register(TritonSparseMLAAttention())


@hookimpl
def register_kernels(register):
    for op, impl in KERNELS.items():
        register(op, "cuda", impl, priority=KERNEL_PRIORITY)
