"""The core's own hook implementations: the CPU platform, the pure-torch attention
backends (multi-head, MLA and DeepSeek's sparse MLA), the default KV allocator, the torch reference
of every kernel op, the built-in tool-call and reasoning parsers, and the transformers fallback for
architectures no plugin implements."""

from __future__ import annotations

from pagoda.hookspecs import hookimpl

TOOL_PARSERS = {
    "hermes": "pagoda.parsers.tool.hermes:HermesToolParser",
    "llama3_json": "pagoda.parsers.tool.llama3_json:Llama3JsonToolParser",
    "mistral": "pagoda.parsers.tool.mistral:MistralToolParser",
    "deepseek_v3": "pagoda.parsers.tool.deepseek_v3:DeepSeekV3ToolParser",
    "deepseek_v31": "pagoda.parsers.tool.deepseek_v3:DeepSeekV3ToolParser",  # V3.1's layout, same parser
    "pythonic": "pagoda.parsers.tool.pythonic:PythonicToolParser",
}
REASONING_PARSERS = {
    "qwen3": "pagoda.parsers.reasoning.qwen3:Qwen3ReasoningParser",
    "deepseek_r1": "pagoda.parsers.reasoning.deepseek_r1:DeepSeekR1ReasoningParser",
    "deepseek_v3": "pagoda.parsers.reasoning.deepseek_v3:DeepSeekV3ReasoningParser",
}


@hookimpl
def register_platforms(register):
    from pagoda.platforms.cpu import CpuPlatform

    register(CpuPlatform())


@hookimpl
def register_attention_backends(register):
    from pagoda.attention.cpu_sdpa import CpuSdpaAttention
    from pagoda.attention.torch_mla import TorchMLAAttention
    from pagoda.attention.torch_mla_sparse import TorchSparseMLAAttention
    from pagoda.attention.torch_paged import TorchPagedAttention

    register(TorchPagedAttention())
    register(CpuSdpaAttention())
    register(TorchMLAAttention())
    register(TorchSparseMLAAttention())


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
    for op in ("lora_shrink", "lora_expand"):  # pagoda.lora.ops, the batched LoRA update
        register(op, "*", f"pagoda.lora.ops:{op}", priority=0)
    # grammar masks on logits (structured outputs): xgrammar's own function, any device
    register("apply_token_bitmask", "*", "pagoda.structured_outputs.masking:apply_token_bitmask", priority=0)
    for op in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "store_kv_cache"):
        register(op, "cpu", f"pagoda.kernels.cpu_ops:{op}", priority=1)  # float32, one C call each


@hookimpl
def register_tool_parsers(register):
    for name, parser in TOOL_PARSERS.items():
        register(name, parser)


@hookimpl
def register_reasoning_parsers(register):
    for name, parser in REASONING_PARSERS.items():
        register(name, parser)
