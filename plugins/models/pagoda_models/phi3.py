"""Phi-3 (and Phi-3.5/Phi-4-mini): Llama layers with fused qkv_proj and gate_up_proj in the
checkpoint, LongRoPE scaling and an optional sliding window.

The decoder is Llama's (pre-norm residual blocks, SiLU-gated MLP, no biases); what differs is
the checkpoint layout and the rope settings, which the core layers read from the config:

- ``qkv_proj.weight`` [(Nq + 2 Nkv) * d, H] and ``gate_up_proj.weight`` [2I, H] are split into
  their q/k/v and gate/up pieces on load, so each tensor-parallel rank takes its own heads
  (quantized checkpoints' tensors too, as the quantization method's parameters say);
- rope ``longrope`` (short/long factors, attention factor) through ``config.rope_parameters``,
  which transformers fills from either spelling (hub ``rope_scaling`` + ``rope_theta``, or
  transformers 5's ``rope_parameters``); ``partial_rotary_factor`` rotates the first part
  of each head;
- ``sliding_window`` applies to every layer when set.

LongRoPE: a token uses the long factors when its sequence is longer than
``original_max_position_embeddings`` at the time the token is computed (prompt tokens: the
prompt length; generated tokens: their position + 1), as transformers does with its cache.
"""

from __future__ import annotations

import torch
from pagoda.errors import ModelLoadError
from pagoda.loader.weights import LLAMA_STACKED, load_by_name

from pagoda_models.llama import LlamaForCausalLM, head_dim_of


class _SplitFused:
    """The checkpoint's tensors with fused qkv_proj / gate_up_proj split into HF's separate
    q_proj/k_proj/v_proj and gate_proj/up_proj names.

    Where the model has a parameter of the fused tensor's name, its loader attributes say how
    to split it (quantized checkpoints): along ``output_dim``, piece sizes divided by
    ``packed_factor`` when packed along that dim (GPTQ ``qzeros``, AWQ ``qweight``/``qzeros``,
    FP8 block scales); a tensor that is not split over the outputs (GPTQ ``g_idx``) or holds
    one value for the fused tensor (FP8 per-tensor ``weight_scale``/``input_scale``, loaded
    per piece) goes to every piece whole. Otherwise the fused dimension is the one of the
    fused size."""

    def __init__(self, weights, config, params: dict[str, torch.nn.Parameter]):
        self.weights = weights
        self.params = params
        hd = head_dim_of(config)
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.pieces = {
            "qkv_proj": (("q_proj", config.num_attention_heads * hd), ("k_proj", kv_heads * hd),
                         ("v_proj", kv_heads * hd)),
            "gate_up_proj": (("gate_proj", config.intermediate_size), ("up_proj", config.intermediate_size)),
        }
        self.origin: dict[str, str] = {}

    def where(self, name: str) -> str:
        base = getattr(self.weights, "where", None)
        return base(self.origin.get(name, name)) if base is not None else "checkpoint"

    def _split(self, name: str, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        param = self.params.get(name)
        if param is None:
            dim = next((d for d in range(tensor.dim()) if tensor.shape[d] == sum(sizes)), None)
            if dim is None:
                raise ModelLoadError(f"{self.where(name)}: tensor {name!r} has shape {tuple(tensor.shape)}; "
                                     f"no dimension matches the fused size {sum(sizes)} that config.json implies")
            return list(torch.split(tensor, sizes, dim=dim))
        if getattr(param, "per_shard", False) or getattr(param, "output_dim", None) is None:
            return [tensor] * len(sizes)
        dim = param.output_dim
        factor = getattr(param, "packed_factor", 1) if getattr(param, "packed_dim", None) == dim else 1
        stored = [size // factor for size in sizes]
        if any(size % factor for size in sizes) or tensor.dim() <= dim or tensor.shape[dim] != sum(stored):
            packing = f", packed {factor} per element" if factor > 1 else ""
            raise ModelLoadError(f"{self.where(name)}: tensor {name!r} has shape {tuple(tensor.shape)}; dim {dim} "
                                 f"should hold the fused size {sum(sizes)} that config.json implies (pieces {sizes}"
                                 f"{packing})")
        return list(torch.split(tensor, stored, dim=dim))

    def __iter__(self):
        for name, tensor in self.weights:
            fused = next((f for f in self.pieces if f".{f}." in name), None)
            if fused is None:
                yield name, tensor
                continue
            parts = self.pieces[fused]
            for (part, _), piece in zip(parts, self._split(name, tensor, [size for _, size in parts])):
                new_name = name.replace(f".{fused}.", f".{part}.")
                self.origin[new_name] = name
                yield new_name, piece


class Phi3ForCausalLM(LlamaForCausalLM):
    FEATURES = ("fused qkv_proj/gate_up_proj split per rank on load; rope default or LongRoPE (short/long "
                "factors, attention factor, both config spellings); partial rotary; sliding window")
    TESTED = ("prompt logits (fp32) and 32+ greedy tokens with chunked prefill and preemption, LongRoPE "
              "on/off, prompts longer than original_max_position_embeddings, hub-style and "
              "`rope_parameters` configs, recompute after preemption past the switch, sliding window "
              "(plugins/models/tests/test_models_phi3.py, tests/test_rotary.py); GPTQ, AWQ and FP8 checkpoints, "
              "also split over 2 ranks (plugins/quant/tests/test_quant_checkpoints.py, "
              "plugins/quant/tests/test_quant_tp.py)")
    qkv_bias = False
    o_bias = False

    def load_weights(self, weights) -> set[str]:
        tied = getattr(self.config, "tie_word_embeddings", False)

        def skip(name: str) -> bool:
            return "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")

        return load_by_name(self, _SplitFused(weights, self.config, dict(self.named_parameters())), LLAMA_STACKED,
                            skip=skip)
