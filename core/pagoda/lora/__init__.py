"""Multi-LoRA serving: PEFT adapters on one base model, mixed in one batch (docs/lora.md).

``LoRARequest`` names an adapter; ``pagoda.lora.peft_format`` reads it, ``pagoda.lora.layers``
adds its low-rank update to the base linear layers, ``pagoda.lora.manager`` keeps the resident
adapters in a slot pool (LRU), ``pagoda.lora.ops`` is the torch reference of the batched
shrink/expand ops (Triton kernels in pagoda-cuda).
"""

from pagoda.lora.request import LoRARequest

__all__ = ["LoRARequest"]
