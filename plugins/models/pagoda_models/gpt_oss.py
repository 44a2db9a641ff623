"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): attention with sinks, alternating sliding-window and
global layers, YaRN, and MoE MLPs with expert biases and a clamped SwiGLU.

Attention: q/k/v/o with biases, scale ``head_dim ** -0.5``; every query head has a learned
sink logit (``self_attn.sinks``) that joins its softmax's denominator; layers alternate
``sliding_attention`` (window ``sliding_window``) and ``full_attention`` (``layer_types``);
rope YaRN (``truncate: false``) on the halves of each head.

MLP (``mlp``): router ``router`` [E, H] with a bias -> the ``num_experts_per_tok`` largest
logits, softmax over them (the experts and weights of softmax-then-top-k renormalised) ->
the experts through ``FusedMoE(has_bias=True)`` with activation ``swigluoai``:
``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)`` with ``g = min(gate, 7)``.

Checkpoints stack the experts transposed with gate and up interleaved (``experts.gate_up_proj``
[E, H, 2I], columns gate 0, up 0, gate 1, ...; ``down_proj`` [E, I, H]; biases [E, 2I] and
[E, H]). The published checkpoints store the two projections as MXFP4 ``*_blocks`` /
``*_scales`` ([E, 2I, H/32, 16], not transposed; ``quant_method: mxfp4``), dequantized here
at load, expert by expert, to the model dtype: pagoda has no MXFP4 kernel yet.

Norms: RMSNorm whose float32 weight multiplies before the rounding (``offset=0.0``).
"""

from __future__ import annotations

import logging
import re

import torch
from pagoda.distributed import get_tp_rank, get_tp_size, tensor_parallel_all_reduce
from pagoda.errors import ModelLoadError
from pagoda.layers import Attention, FusedMoE, ReplicatedLinear, RMSNorm, Routing
from pagoda.loader.mxfp4 import dequantize_mxfp4
from pagoda.loader.weights import LLAMA_STACKED, load_by_name
from torch import nn

from pagoda_models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

logger = logging.getLogger("pagoda")
SWIGLU_LIMIT = 7.0  # the clamp of the swigluoai activation (pagoda.kernels.reference)
_EXPERT_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def _norm(config) -> RMSNorm:
    return RMSNorm(config.hidden_size, config.rms_norm_eps, offset=0.0, params_dtype=torch.float32)


class GptOssAttention(LlamaAttention):
    """Llama's attention (q/k/v/o biases, YaRN, window from ``layer_types``) with sink logits."""

    def __init__(self, config, layer_idx: int, quant_config, prefix: str, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool):
        super().__init__(config, layer_idx, quant_config, prefix, qkv_bias, o_bias, qk_norm)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks
        spec = self.attn.spec
        self.attn = Attention(spec.num_heads, spec.head_size, spec.scale, spec.num_kv_heads,
                              sliding_window=spec.sliding_window, prefix=f"{prefix}.attn", sinks=self.sinks)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        start = get_tp_rank() * self.num_heads  # this rank's heads
        if loaded.shape[0] != self.num_heads * get_tp_size():
            raise ModelLoadError(f"sinks have {loaded.shape[0]} values; config says "
                                 f"{self.num_heads * get_tp_size()} heads")
        param.data.copy_(loaded.narrow(0, start, self.num_heads))


class GptOssMoE(nn.Module):
    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        hidden, experts = config.hidden_size, config.num_local_experts
        self.tp_size = get_tp_size()
        routing = Routing(num_experts=experts, top_k=config.num_experts_per_tok, scoring="softmax", renormalize=True)
        self.router = ReplicatedLinear(hidden, experts, bias=True, prefix=f"{prefix}.router")
        self.experts = FusedMoE(routing, hidden, config.intermediate_size, "swigluoai", reduce_results=False,
                                quant_config=quant_config, prefix=f"{prefix}.experts", has_bias=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.router(hidden))
        return tensor_parallel_all_reduce(out) if self.tp_size > 1 else out


class GptOssDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx: int, quant_config, prefix: str, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool):
        nn.Module.__init__(self)
        self.self_attn = GptOssAttention(config, layer_idx, quant_config, f"{prefix}.self_attn", qkv_bias, o_bias,
                                         qk_norm)
        self.mlp = GptOssMoE(config, quant_config, f"{prefix}.mlp")
        self.input_layernorm = _norm(config)
        self.post_attention_layernorm = _norm(config)


class _Weights:
    """The checkpoint stream without the expert tensors (handed to ``on_expert``), keeping the
    stream's ``where`` for error messages."""

    def __init__(self, stream, on_expert):
        self.stream, self.on_expert = stream, on_expert
        self.where = getattr(stream, "where", lambda name: "checkpoint")

    def __iter__(self):
        for name, tensor in self.stream:
            match = _EXPERT_TENSOR.match(name)
            if match is None:
                yield name, tensor
            else:
                self.on_expert(name, match, tensor)


class GptOssForCausalLM(LlamaForCausalLM):
    FEATURES = ("attention sinks, alternating sliding-window and global layers (window layers keep only their "
                "window's KV blocks), YaRN, q/k/v/o biases; MoE with a "
                "biased router, expert biases and the clamped SwiGLU (swigluoai) via fused_moe; MXFP4 experts of "
                "the published checkpoints dequantized to the model dtype at load (no MXFP4 kernel yet)")
    TESTED = ("prompt logits (fp32) and 32+ greedy tokens with chunked prefill, preemption and prefix caching; an "
              "MXFP4 checkpoint against transformers on the same dequantized weights; Triton path under the "
              "interpreter; expert counts vs the HF router (plugins/models/tests/test_models_mixtral_gpt_oss.py); "
              "2 tensor-parallel ranks (tests/test_distributed.py)")
    decoder_layer = GptOssDecoderLayer

    def __init__(self, config, quant_config=None, prefix: str = ""):
        limit = getattr(config, "swiglu_limit", SWIGLU_LIMIT)
        if limit != SWIGLU_LIMIT:
            raise ModelLoadError(f"config swiglu_limit={limit} is not supported (GPT-OSS clamps at {SWIGLU_LIMIT})")
        super().__init__(config, quant_config, prefix)
        self.model.norm = _norm(config)

    def attention_biases(self, config) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", True))
        return bias, bias

    def load_weights(self, weights) -> set[str]:
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        packed: dict[str, torch.Tensor] = {}  # MXFP4 halves waiting for their other half
        where = getattr(weights, "where", lambda name: "checkpoint")
        said = []

        def load_expert(name: str, match: re.Match, tensor: torch.Tensor) -> None:
            prefix, proj, kind = match.group(1), match.group(2), match.group(3) or ""
            experts = modules.get(prefix)
            if not isinstance(experts, FusedMoE):
                raise ModelLoadError(f"{where(name)}: tensor {name!r} does not belong to this model")
            gate_up = proj == "gate_up_proj"
            if kind in ("_blocks", "_scales"):
                key = f"{prefix}.{proj}"
                other = packed.pop(key + ("_scales" if kind == "_blocks" else "_blocks"), None)
                if other is None:
                    packed[key + kind] = tensor
                    return
                blocks, scales = (tensor, other) if kind == "_blocks" else (other, tensor)
                if not said:
                    said.append(logger.info("gpt-oss: MXFP4 experts dequantized to %s at load (pagoda has no "
                                            "MXFP4 kernel)", str(experts.params_dtype).replace("torch.", "")))
                for e in range(blocks.shape[0]):  # one expert at a time: [R, C] in the model dtype
                    _load_projection(experts, gate_up, e, dequantize_mxfp4(blocks[e], scales[e],
                                                                           experts.params_dtype, name))
                loaded.add(f"{prefix}.{'w13_weight' if gate_up else 'w2_weight'}")
            elif kind == "_bias":
                param = experts.w13_bias if gate_up else experts.w2_bias
                for e in range(tensor.shape[0]):
                    _load_projection(experts, gate_up, e, tensor[e], param)
                loaded.add(f"{prefix}.{'w13_bias' if gate_up else 'w2_bias'}")
            else:  # stacked and transposed: [E, H, 2I] / [E, I, H]
                for e in range(tensor.shape[0]):
                    _load_projection(experts, gate_up, e, tensor[e].t())
                loaded.add(f"{prefix}.{'w13_weight' if gate_up else 'w2_weight'}")

        def skip(name: str) -> bool:
            tied = getattr(self.config, "tie_word_embeddings", False)
            return "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")

        loaded |= load_by_name(self, _Weights(weights, load_expert), LLAMA_STACKED, skip=skip)
        if packed:
            raise ModelLoadError(f"MXFP4 tensors without their other half (blocks and scales): {', '.join(packed)}")
        return loaded


def _load_projection(experts: FusedMoE, gate_up: bool, e: int, rows: torch.Tensor, param=None) -> None:
    """One expert's gate_up ([2I, H] rows interleaved gate, up, ... or a [2I] bias) or down
    ([H, I] or an [H] bias) into the stacked parameters."""
    if gate_up:
        param = experts.w13_weight if param is None else param
        experts.weight_loader(param, rows[0::2], "w1", e)
        experts.weight_loader(param, rows[1::2], "w3", e)
    else:
        experts.weight_loader(experts.w2_weight if param is None else param, rows, "w2", e)
