"""Reading a PEFT LoRA adapter directory: ``adapter_config.json`` + ``adapter_model.safetensors``.

The result names each adapted module as the base checkpoint does (``model.layers.0.self_attn.q_proj``)
with its ``lora_A`` [r, in] and ``lora_B`` [out, r] weights and its scaling (``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``). Options that change the math in ways the serving path
does not compute are refused with the key that asks for them. Weights are read with ``safetensors``;
pickled ``.bin`` adapters are refused (loading them would run arbitrary code).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagoda.errors import PagodaError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
# config key -> the value that means "not used"; anything else is refused
UNSUPPORTED_OPTIONS = {
    "use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
    "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "layer_replication": None,
    "lora_bias": False, "use_qalora": False, "trainable_token_indices": None, "alora_invocation_tokens": None,
    "target_parameters": None, "use_bdlora": None,
}
UNSUPPORTED_MODULES = {"embed_tokens": "embeddings", "lm_head": "lm_head", "wte": "embeddings"}


class LoRAError(PagodaError):
    """An adapter that cannot be loaded or served (the message names the file and key)."""


@dataclass
class LoRAAdapter:
    name: str
    int_id: int
    path: str
    rank: int
    scaling: float
    # base module name -> (lora_A [r, in], lora_B [out, r]), on the CPU in float32
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def read_adapter_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise LoRAError(f"LoRA adapter path {str(path)!r} is not a directory")
    if not file.is_file():
        raise LoRAError(f"LoRA adapter {str(path)!r} has no {CONFIG_FILE} (a PEFT adapter directory holds "
                        f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise LoRAError(f"{file}: not valid JSON: {e}") from None
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"{file}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    for key, unused in UNSUPPORTED_OPTIONS.items():
        value = config.get(key, unused)
        if value not in (unused, None, {}, [], False, "none"):
            raise LoRAError(f"{file}: {key}={value!r} is not supported by pagoda's LoRA serving "
                            f"(supported: r, lora_alpha, use_rslora, target_modules)")
    r = config.get("r")
    if type(r) is not int or r < 1:
        raise LoRAError(f"{file}: r must be a positive integer, got {r!r}")
    return config


def scaling_of(config: dict) -> float:
    r, alpha = config["r"], config.get("lora_alpha", 8)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def load_peft_adapter(path: str, name: str = "", int_id: int = 0) -> LoRAAdapter:
    root = Path(path)
    config = read_adapter_config(root)
    file = root / WEIGHTS_FILE
    if not file.is_file():
        if (root / "adapter_model.bin").is_file():
            raise LoRAError(f"LoRA adapter {path!r} holds only adapter_model.bin, a pickled file pagoda does not "
                            f"load (it could run code); convert it to {WEIGHTS_FILE} (PEFT's save_pretrained "
                            f"writes safetensors by default)")
        raise LoRAError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE}")
    from safetensors.torch import load_file

    tensors = load_file(str(file))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.removeprefix(PREFIX).rpartition(".lora_")
        if not module or kind not in ("A.weight", "B.weight"):
            raise LoRAError(f"{file}: tensor {key!r} is not a lora_A/lora_B weight (embedding adapters, DoRA "
                            f"magnitudes and modules_to_save are not supported)")
        for part, what in UNSUPPORTED_MODULES.items():
            if module.rsplit(".", 1)[-1] == part:
                raise LoRAError(f"{file}: tensor {key!r} adapts the {what}; pagoda serves adapters of linear "
                                f"layers only (q/k/v/o and gate/up/down projections)")
        pairs.setdefault(module, {})[kind[0]] = tensor
    r = config["r"]
    adapter = LoRAAdapter(name, int_id, path, r, scaling_of(config))
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{file}: module {module!r} has lora_{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise LoRAError(f"{file}: module {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                            f"not [r={r}, in] and [out, r={r}]")
        adapter.weights[module] = (a, b)
    if not adapter.weights:
        raise LoRAError(f"{file}: no lora_A/lora_B weights")
    return adapter
