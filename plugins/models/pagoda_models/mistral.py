"""Mistral: Llama with a sliding window (taken from the config by the Llama layers)."""

from pagoda_models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
