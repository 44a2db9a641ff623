"""Random EAGLE-3 head checkpoints (speculative method eagle3, docs/speculative.md), in the layout vLLM and
SGLang read: config.json with ``architectures: ["LlamaForCausalLMEagle3"]`` and ``draft_vocab_size``;
``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` as safetensors, no ``embed_tokens`` (the
target's is shared). Used by the tests and by ``scripts/gpu_speculative.sh``."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_eagle3_head(directory: str | Path, vocab_size: int, hidden_size: int, intermediate_size: int,
                     draft_ids: torch.Tensor | None = None, seed: int = 0, tensors: dict | None = None,
                     num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int | None = None,
                     **config) -> str:
    """Write a head with random weights (``tensors`` overrides some) into ``directory``; ``draft_ids``: the
    target id of each draft id (default: the whole vocabulary); ``config``: more config.json keys."""
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    heads, kv = num_attention_heads, num_key_value_heads
    hd = head_dim or hidden_size // heads
    draft_ids = torch.arange(vocab_size) if draft_ids is None else draft_ids.long()
    draft = len(draft_ids)
    settings = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden_size,
                "intermediate_size": intermediate_size, "num_attention_heads": heads, "num_key_value_heads": kv,
                "head_dim": hd, "num_hidden_layers": 1, "vocab_size": vocab_size, "draft_vocab_size": draft,
                "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "torch_dtype": "float32", **config}
    (path / "config.json").write_text(json.dumps(settings, indent=1))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.2

    h = hidden_size
    w = {"fc.weight": rand(h, 3 * h) * 0.5, "norm.weight": 1 + rand(h), "lm_head.weight": rand(draft, h) * 5,
         "d2t": draft_ids - torch.arange(draft), "t2d": torch.isin(torch.arange(vocab_size), draft_ids)}
    for name, shape in [("self_attn.q_proj", (heads * hd, 2 * h)), ("self_attn.k_proj", (kv * hd, 2 * h)),
                        ("self_attn.v_proj", (kv * hd, 2 * h)), ("self_attn.o_proj", (h, heads * hd)),
                        ("mlp.gate_proj", (intermediate_size, h)), ("mlp.up_proj", (intermediate_size, h)),
                        ("mlp.down_proj", (h, intermediate_size))]:
        w[f"midlayer.{name}.weight"] = rand(*shape)
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"midlayer.{norm}.weight"] = 1 + rand(h)
    w.update(tensors or {})
    save_file({k: v.clone().contiguous() for k, v in w.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return str(path)
