"""Random PEFT LoRA adapters for tests, and transformers+peft reference tokens (needs ``peft``,
a test dependency: requirements-dev.txt)."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(base: str | Path, directory: str | Path, r: int = 8, lora_alpha: int = 16,
                      target_modules=ALL_LINEAR, use_rslora: bool = False, seed: int = 0, std: float = 0.1) -> Path:
    """A LoRA adapter of the checkpoint ``base`` with random non-zero A and B (N(0, ``std``)),
    saved with PEFT's ``save_pretrained`` (adapter_config.json + adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), use_rslora=use_rslora,
                        lora_dropout=0.0, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    peft_model.save_pretrained(str(directory))
    return Path(directory)


def peft_greedy_tokens(base: str | Path, adapter: str | Path | None, prompts: list[list[int]],
                       max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations by transformers with the adapter applied by peft (None: the base)."""
    from transformers import AutoModelForCausalLM

    from pagoda.testing.reference import hf_greedy_tokens

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    return hf_greedy_tokens(base, prompts, max_new_tokens, model=model)
