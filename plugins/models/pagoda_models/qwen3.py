"""Qwen3: Llama with RMSNorm on each query and key head before rotary, explicit head_dim."""

from pagoda_models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
