"""The attention layer models use: it reads the step's metadata and the selected backend
from the forward context and its own KV cache tensor (bound by the runner)."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.errors import ModelLoadError
from pagoda.forward_context import get_forward_context
from pagoda.interfaces import AttentionSpec

KV_SCALE_KEYS = ("k_scale", "v_scale")
# checkpoint tensor suffix (after the attention block's prefix) -> the scales it sets
_KV_SCALE_NAMES = {".k_scale": ("k_scale",), ".v_scale": ("v_scale",), ".kv_scale": KV_SCALE_KEYS,
                   ".k_proj.output_scale": ("k_scale",), ".v_proj.output_scale": ("v_scale",)}


def is_quantized_kv_cache(cache: torch.Tensor) -> bool:
    """An 8-bit float cache stores k / k_scale (see Attention.kv_scales)."""
    return cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def load_kv_cache_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Store a checkpoint's KV cache scale (``...self_attn.k_scale``, ``.v_scale``, ``.kv_scale``
    or ``.k_proj.output_scale``/``.v_proj.output_scale``, as FP8 checkpoints name them) in the
    attention layer under that block; False if ``name`` is not one."""
    for suffix, keys in _KV_SCALE_NAMES.items():
        if not name.endswith(suffix):
            continue
        block = name[: -len(suffix)]
        for module in model.modules():
            prefix = getattr(module, "prefix", None)
            if isinstance(module, Attention) and prefix and block in (prefix, prefix.rpartition(".")[0]):
                if tensor.numel() != 1:
                    raise ModelLoadError(f"KV cache scale {name!r} must hold one value, got shape "
                                         f"{tuple(tensor.shape)}")
                scales = dict(module.kv_scales or {})
                scales.update({key: tensor.detach().float().reshape(()).clone() for key in keys})
                module.kv_scales = scales
                return True
    return False


class Attention(nn.Module):
    """Multi-head / grouped-query attention over the paged cache.

    forward(q [T, nq*hs], k [T, nk*hs], v [T, nk*hs]) -> [T, nq*hs]

    ``sinks``: the model's parameter of per-head sink logits [nq] (GPT-OSS), owned and loaded by
    the model; each head's softmax denominator gains ``exp(sink)``.
    """

    kind = "mha"

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None, prefix: str = "",
                 sinks: torch.Tensor | None = None):
        super().__init__()
        self.prefix = prefix
        self.spec = AttentionSpec(kind=self.kind, num_heads=num_heads,
                                  num_kv_heads=num_kv_heads or num_heads, head_size=head_size,
                                  scale=scale, sliding_window=sliding_window,
                                  logits_soft_cap=logits_soft_cap, sinks=sinks is not None)
        self._sinks = (sinks,)  # a tuple: the model owns (and loads) the parameter
        self.kv_cache: torch.Tensor | None = None
        self.layer_index = -1  # position among the model's attention layers, set by the runner
        self.kv_group = 0  # its KV cache group (block tables it reads), set by the runner
        # Per-layer scales of a quantized (fp8) KV cache: {"k_scale": t, "v_scale": t}, float32
        # 0-dim tensors on the cache's device; cache = k / k_scale, read back as cache * k_scale.
        # From the checkpoint when it has them (load_kv_cache_scale), else 1.0.
        self.kv_scales: dict | None = None

    @property
    def sinks(self) -> torch.Tensor | None:
        return self._sinks[0]

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        self.kv_cache = cache
        if is_quantized_kv_cache(cache):
            scales = self.kv_scales or {}
            self.kv_scales = {key: scales.get(key, torch.ones(())).to(device=cache.device, dtype=torch.float32)
                              for key in KV_SCALE_KEYS}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        backend = ctx.backends[self.kind]
        return backend.forward(self, q, k, v, self.kv_cache, ctx.metadata_for(self.kind, self.kv_group))
