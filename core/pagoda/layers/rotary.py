"""Rotary position embedding with every scaling HF configs use.

All scalings reduce to a float32 table of (cos, sin) per position, with any attention
scaling (YaRN mscale, LongRoPE factor) folded in, so one kernel serves them all. Scalings
that depend on the sequence length (LongRoPE's short/long factors, dynamic NTK) keep two
tables stacked: rows ``[0, P)`` for sequences up to the original length and rows
``[P, 2P)`` for longer ones; each token picks its table from the length its sequence has
when the token is computed (``ForwardContext.token_seq_lens``: the prompt length for prompt
tokens, position + 1 for generated ones), as HF transformers does with its cache (prefill
at the prompt length, then one token at a time). Such a rotation depends on more than the
token's position, so the engine turns prefix caching off for these models
(``uses_sequence_length``).
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from pagoda.errors import ModelLoadError
from pagoda.forward_context import get_forward_context
from pagoda.kernels import get_op

SCALINGS = ("default", "linear", "dynamic", "yarn", "deepseek_yarn", "longrope", "llama3")


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict, base: float, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor") or max_position / params["original_max_position_embeddings"]
    original = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1 keeps the original frequency
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)


def _llama3(params: dict, base: float, dim: int) -> torch.Tensor:
    inv = _base_inv_freq(base, dim)
    factor, low_f, high_f = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low_f, inv / factor, inv)
    smooth = (old_len / wavelen - low_f) / (high_f - low_f)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high_f) & ~(wavelen > old_len / low_f)
    return torch.where(medium, smoothed, scaled)


def _table(inv_freq: torch.Tensor, length: int, scale: float) -> torch.Tensor:
    t = torch.arange(length, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)


class RotaryEmbedding(nn.Module):
    """forward(positions [T], q [T, nq*hs], k [T, nk*hs]) -> rotated (q, k)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, rope_parameters: dict | None,
                 is_neox_style: bool = True):
        super().__init__()
        params = dict(rope_parameters or {})
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind == "su":
            kind = "longrope"
        if kind not in SCALINGS:
            raise ModelLoadError(f"config rope_parameters.rope_type={kind!r} is not supported "
                                 f"(supported: {', '.join(SCALINGS)})")
        base = float(params.get("rope_theta", 10000.0))
        dim = rotary_dim
        self.head_size, self.rotary_dim, self.is_neox = head_size, rotary_dim, is_neox_style
        self.kind = kind
        self.long_threshold: int | None = None  # sequences longer than this use rows [P, 2P)
        scale = 1.0
        if kind == "default":
            table = _table(_base_inv_freq(base, dim), max_position, 1.0)
        elif kind == "linear":
            table = _table(_base_inv_freq(base, dim) / params["factor"], max_position, 1.0)
        elif kind == "llama3":
            table = _table(_llama3(params, base, dim), max_position, 1.0)
        elif kind in ("yarn", "deepseek_yarn"):
            inv, scale = _yarn(params, base, dim, max_position)
            table = _table(inv, max_position, scale)
        elif kind == "dynamic":
            # Up to the original length HF uses the plain frequencies; beyond it, NTK-scaled
            # ones, fixed at the longest supported length (HF recomputes them per length).
            factor = params["factor"]
            original = max_position
            length = int(original * factor)
            ntk_base = base * ((factor * length / original) - (factor - 1)) ** (dim / (dim - 2))
            short = _table(_base_inv_freq(base, dim), length, 1.0)
            long = _table(_base_inv_freq(ntk_base, dim), length, 1.0)
            table = torch.cat((short, long))
            self.long_threshold = original
        else:  # longrope
            original = params["original_max_position_embeddings"]
            factor = params.get("factor") or max_position / original
            scale = params.get("attention_factor")
            if scale is None:
                scale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
            shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
            tables = []
            for key in ("short_factor", "long_factor"):
                ext = torch.tensor(params[key], dtype=torch.float32)
                if ext.numel() != dim // 2:
                    raise ModelLoadError(f"config rope_parameters.{key} has {ext.numel()} values; "
                                         f"expected rotary_dim/2 = {dim // 2}")
                tables.append(_table(1.0 / (ext * base ** shape), max(max_position, original), scale))
            table = torch.cat(tables)
            self.long_threshold = original
        self.table_rows = table.shape[0] // (2 if self.long_threshold is not None else 1)
        self.attention_scaling = scale
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module | None = None,
                k_norm: nn.Module | None = None):
        """q [T, nq*hs], k [T, nk*hs] -> rotated (q, k). With ``q_norm`` and ``k_norm`` (RMSNorm
        over head_size, as Qwen3 has), every head is normalised first, in the same op."""
        index = positions
        if self.long_threshold is not None:
            seq_lens = get_forward_context().token_seq_lens
            if seq_lens is not None:
                index = positions + (seq_lens > self.long_threshold).to(positions.dtype) * self.table_rows
        if q_norm is not None and k_norm is not None:
            return get_op("qk_norm_rotary")(index, q, k, q_norm.weight, k_norm.weight, q_norm.eps, self.head_size,
                                            self.cos_sin_cache, self.is_neox)
        return get_op("rotary_embedding")(index, q, k, self.head_size, self.cos_sin_cache, self.is_neox)


# Live rotary layers by construction arguments and device: the layers of a model share one
# table (a 128k-position table of 128 dims is 64 MiB; one per layer would be gigabytes).
_ROPES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def get_rope(head_size: int, rotary_dim: int, max_position: int, rope_parameters: dict | None,
             is_neox_style: bool = True) -> RotaryEmbedding:
    """A rotary layer for these settings, shared with any live layer built with the same ones
    on the same default device (the table is read-only)."""
    key = (head_size, rotary_dim, max_position, repr(sorted((rope_parameters or {}).items())), is_neox_style,
           str(torch.get_default_device()))
    rope = _ROPES.get(key)
    if rope is None:
        rope = RotaryEmbedding(head_size, rotary_dim, max_position, rope_parameters, is_neox_style)
        _ROPES[key] = rope
    return rope


def rope_parameters_of(hf_config) -> dict:
    """The rope settings of an HF config in transformers 5's ``rope_parameters`` form,
    also from the older ``rope_scaling`` + ``rope_theta`` spelling."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        out = dict(params)
    else:
        out = dict(getattr(hf_config, "rope_scaling", None) or {})
    if "rope_theta" not in out:
        out["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    out.setdefault("rope_type", out.get("type", "default"))
    if out["rope_type"] in ("longrope", "llama3", "yarn") and "original_max_position_embeddings" not in out:
        out["original_max_position_embeddings"] = getattr(
            hf_config, "original_max_position_embeddings", getattr(hf_config, "max_position_embeddings", 0))
    return out


def uses_sequence_length(model: nn.Module, max_model_len: int) -> bool:
    """Whether a rotary layer of ``model`` rotates a position differently depending on its
    sequence's length for sequences up to ``max_model_len`` (LongRoPE, dynamic NTK beyond
    their switch length): cached blocks of one sequence are then not reusable by another."""
    return any(isinstance(m, RotaryEmbedding) and m.long_threshold is not None and max_model_len > m.long_threshold
               for m in model.modules())
