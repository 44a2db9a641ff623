"""Llama (and the models that differ from it only by biases, q/k norms or windows)."""

from __future__ import annotations

import torch
from pagoda.distributed import get_tp_size
from pagoda.distributed.pipeline_parallel import (
    MissingLayer,
    current_stage,
    is_first_stage,
    is_last_stage,
    is_pipelined,
    resolve_ranges,
    stage_forward,
    stage_layers,
)
from pagoda.kernels.cpu_decoder import DecoderLayerParts, FusedDecode
from pagoda.layers import (
    Attention,
    GatedActivation,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope,
    rope_parameters_of,
)
from pagoda.loader.weights import LLAMA_STACKED, load_by_name
from torch import nn


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool, quant_config, prefix: str,
                 reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias=bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        # reduce_results=False: a MoE block sums this with its experts and all-reduces once
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj", reduce_results=reduce_results)
        self.act_fn = GatedActivation(act)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, quant_config, prefix: str, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool):
        super().__init__()
        tp = get_tp_size()
        hidden = config.hidden_size
        self.head_dim = hd = head_dim_of(config)
        total_heads = config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or total_heads
        self.qkv_proj = QKVParallelLinear(hidden, hd, total_heads, total_kv, bias=qkv_bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(total_heads * hd, hidden, bias=o_bias, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        params = rope_parameters_of(config)
        rotary_dim = int(hd * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
        self.rotary_emb = get_rope(hd, rotary_dim, config.max_position_embeddings, params, is_neox_style=True)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(hd, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, hd, hd ** -0.5, self.num_kv_heads,
                              sliding_window=sliding_window_of(config, layer_idx), prefix=f"{prefix}.attn")
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        del tp

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm)  # q/k norms (Qwen3) fused in
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, quant_config, prefix: str, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, quant_config, f"{prefix}.self_attn", qkv_bias,
                                        o_bias, qk_norm)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            getattr(config, "mlp_bias", False), quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def fused_decode_parts(self) -> DecoderLayerParts | None:
        """This layer's pieces for the CPU's fused decode (None: a variant whose forward differs)."""
        attn = self.self_attn
        if (type(self).forward is not LlamaDecoderLayer.forward or type(attn) is not LlamaAttention
                or type(self.mlp) is not LlamaMLP):
            return None
        return DecoderLayerParts(self.input_layernorm, self.post_attention_layernorm, attn.qkv_proj, attn.o_proj,
                                 self.mlp.gate_up_proj, self.mlp.down_proj, attn.rotary_emb, attn.attn,
                                 self.mlp.act_fn, attn.q_norm, attn.k_norm)


class LlamaModel(nn.Module):
    supports_pipeline_parallel = True  # pagoda.distributed.pipeline_parallel.stage_forward runs it

    def __init__(self, config, quant_config, prefix: str, layer_cls=LlamaDecoderLayer, **layer_kw):
        super().__init__()
        # under pipeline parallelism a stage builds only its layers (the others: MissingLayer)
        resolve_ranges(config.num_hidden_layers)
        start, end = stage_layers(config.num_hidden_layers)
        self.embed_tokens = MissingLayer() if not is_first_stage() else VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            layer_cls(config, i, quant_config, f"{prefix}.layers.{i}", **layer_kw) if start <= i < end
            else MissingLayer() for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if is_last_stage() else MissingLayer()
        self.pp_hidden_spec = (config.hidden_size, torch.get_default_dtype(), torch.get_default_device())
        self.pipeline_stage = current_stage(config.num_hidden_layers)
        # opt-in (speculative method eagle3): the residual stream entering these layers, recorded each forward
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: dict[int, torch.Tensor] = {}
        # decode steps on the CPU: every layer in one C call where the layers allow (pagoda.kernels.cpu_decoder)
        self.fused_decode = FusedDecode(lambda: [getattr(layer, "fused_decode_parts", lambda: None)()
                                                 for layer in self.layers])

    def forward(self, input_ids, positions):
        if self.pipeline_stage is not None:
            return stage_forward(self, self.pipeline_stage, input_ids, positions)
        hidden, residual = self.embed_tokens(input_ids), None
        if not self.aux_hidden_state_layers:
            stream = self.fused_decode(hidden, positions)
            if stream is not None:
                return self.norm(stream)
        for i, layer in enumerate(self.layers):
            if i in self.aux_hidden_state_layers:  # (speculative method eagle3)
                self.aux_hidden_states[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    TESTED = ("prompt logits (fp32) and 32 greedy tokens with chunked prefill and preemption; family variants: "
              "attention bias, MHA, tied embeddings (Llama), q/k norm (Qwen3), sliding window (Mistral) "
              "(plugins/models/tests/test_llama_family.py)")
    # None: take the config's attention_bias
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    qk_norm = False
    decoder_layer = LlamaDecoderLayer  # subclasses swap the layer (e.g. MoE MLPs)
    supports_eagle3 = True  # its LlamaModel records the aux hidden states an EAGLE-3 head reads

    def attention_biases(self, config) -> tuple[bool, bool]:
        """(qkv bias, o_proj bias) of this architecture for ``config``."""
        bias = bool(getattr(config, "attention_bias", False))
        return (bias if self.qkv_bias is None else self.qkv_bias), (bias if self.o_bias is None else self.o_bias)

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        qkv_bias, o_bias = self.attention_biases(config)
        self.model = LlamaModel(config, quant_config, "model", layer_cls=self.decoder_layer, qkv_bias=qkv_bias,
                                o_bias=o_bias, qk_norm=self.qk_norm)
        if not is_first_stage():  # the LM head lives with the embedding, on pipeline stage 0
            self.lm_head, self.supports_graphs = MissingLayer(), False
            return
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)
        if is_pipelined():
            self.supports_graphs = False  # the stages' send/recv run eagerly

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lm_head, MissingLayer):  # a later pipeline stage: stage 0 computes the logits
            return hidden.new_empty(hidden.shape[0], 0)
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights) -> set[str]:
        tied = getattr(self.config, "tie_word_embeddings", False)

        def skip(name: str) -> bool:
            return "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")

        return load_by_name(self, weights, LLAMA_STACKED, skip=skip)
