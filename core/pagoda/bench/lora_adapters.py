"""Random PEFT-format LoRA adapters of a model's shapes, for ``pagoda bench throughput --lora N``
(written with safetensors; no peft needed): rank ``r`` on every q/k/v/o and gate/up/down projection."""

from __future__ import annotations

import json
from pathlib import Path

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of one decoder layer."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    head = getattr(hf_config, "head_dim", None) or hidden // heads
    return {"q_proj": (heads * head, hidden), "k_proj": (kv * head, hidden), "v_proj": (kv * head, hidden),
            "o_proj": (hidden, heads * head), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def write_random_adapters(hf_config, directory: str | Path, count: int, rank: int, seed: int = 0) -> list[Path]:
    import torch
    from safetensors.torch import save_file

    shapes = projection_shapes(hf_config)
    paths = []
    for i in range(count):
        path = Path(directory) / f"adapter-{i}"
        path.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(seed + i)
        tensors = {}
        for layer in range(hf_config.num_hidden_layers):
            for name, (out, inp) in shapes.items():
                kind = "self_attn" if name in PROJECTIONS[:4] else "mlp"
                key = f"base_model.model.model.layers.{layer}.{kind}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) * inp ** -0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.01
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
                  str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
            "lora_dropout": 0.0, "bias": "none", "use_rslora": False}))
        paths.append(path)
    return paths
