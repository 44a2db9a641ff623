"""Qwen2: Llama with biases on q, k and v (not on o)."""

from pagoda_models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False
