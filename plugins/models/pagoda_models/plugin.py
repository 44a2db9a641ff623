"""Entry point of pagoda-models: architecture names -> lazy model classes."""

from pagoda import hookimpl

ARCHITECTURES = {
    "LlamaForCausalLM": "pagoda_models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagoda_models.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "pagoda_models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "pagoda_models.qwen3:Qwen3ForCausalLM",
    "Phi3ForCausalLM": "pagoda_models.phi3:Phi3ForCausalLM",
    "Qwen2MoeForCausalLM": "pagoda_models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "pagoda_models.qwen3_moe:Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM": "pagoda_models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM": "pagoda_models.deepseek_v32:DeepseekV32ForCausalLM",
    "DeepSeekMTPModel": "pagoda_models.deepseek_mtp:DeepSeekMTPModel",  # the drafter of speculative method mtp
    "LlamaForCausalLMEagle3": "pagoda_models.eagle3:LlamaForCausalLMEagle3",  # the drafter of method eagle3
    "Gemma2ForCausalLM": "pagoda_models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "pagoda_models.gemma3:Gemma3ForCausalLM",
    "MixtralForCausalLM": "pagoda_models.mixtral:MixtralForCausalLM",
    "GptOssForCausalLM": "pagoda_models.gpt_oss:GptOssForCausalLM",
    "Qwen2_5_VLForConditionalGeneration": "pagoda_models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
}


@hookimpl
def register_models(register):
    for architecture, target in ARCHITECTURES.items():
        register(architecture, target)
