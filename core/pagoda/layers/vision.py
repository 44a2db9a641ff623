"""Vision-encoder building blocks: patch embedding as a linear map over flattened patches,
bidirectional attention over packed variable-length segments (whole images or windows), a
2-D (height, width) rotary embedding, and the patch merger that folds merge_size x merge_size
neighbouring patches into one language-model token.

A vision tower runs once per image (``pagoda.multimodal``), not over the paged KV cache, so
these layers take plain tensors and no forward context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.linear import ReplicatedLinear
from pagoda.layers.norm import RMSNorm


class PatchEmbed(nn.Module):
    """[N, C*T*P*P] flattened patches (the image processor's ``pixel_values``) -> [N, dim].

    A Conv3d whose stride equals its kernel is a matrix product; checkpoints store the conv
    weight [dim, C, T, P, P], which ``weight_loader`` flattens."""

    def __init__(self, patch_dim: int, dim: int):
        super().__init__()
        self.proj = ReplicatedLinear(patch_dim, dim, bias=False, prefix="patch_embed.proj")
        self.proj.weight.weight_loader = self._load_conv

    @staticmethod
    def _load_conv(param: torch.Tensor, tensor: torch.Tensor) -> None:
        param.data.copy_(tensor.reshape(param.shape))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels.to(self.proj.weight.dtype))


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                     scale: float) -> torch.Tensor:
    """Bidirectional attention within each segment [cu[i], cu[i+1]) of q/k/v [S, H, D] -> [S, H, D].

    Segments of equal length run as one batched SDPA call (windows are mostly the same size), so a
    batch of images costs a few calls, never one per window."""
    out = torch.empty_like(q)
    by_len: dict[int, list[int]] = {}
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if end > start:
            by_len.setdefault(end - start, []).append(start)
    for length, starts in by_len.items():
        idx = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)).reshape(-1)

        shape = (len(starts), length, *q.shape[1:])  # [n, L, H, D] -> SDPA's [n, H, L, D]
        qs, ks, vs = (x.index_select(0, idx).view(shape).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        out.index_copy_(0, idx, o.transpose(1, 2).reshape(-1, *q.shape[1:]))
    return out


class VisionRotary2D(nn.Module):
    """cos/sin [S, head_dim] for patches at (row, column): half the frequencies follow the row,
    half the column (axial rope), laid out for rotate-half application."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        spatial = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial)),
                             persistent=False)

    def forward(self, hw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = hw[..., None].float() * self.inv_freq  # [S, 2, head_dim/4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()


def apply_rotary_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [S, H, D] rotated (rotate-half) by cos/sin [S, D], computed in float32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionAttention(nn.Module):
    """Fused qkv, 2-D rotary, bidirectional attention within segments, output projection."""

    def __init__(self, dim: int, num_heads: int, prefix: str = ""):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = ReplicatedLinear(dim, 3 * dim, bias=True, prefix=f"{prefix}.qkv")
        self.proj = ReplicatedLinear(dim, dim, bias=True, prefix=f"{prefix}.proj")

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        s = x.shape[0]
        q, k, v = self.qkv(x).view(s, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary_2d(q, cos, sin), apply_rotary_2d(k, cos, sin)
        out = varlen_attention(q, k, v, cu_seqlens, self.head_dim ** -0.5)
        return self.proj(out.reshape(s, -1))


class PatchMerger(nn.Module):
    """RMSNorm each patch, concatenate merge_size**2 neighbours, then a 2-layer GELU MLP to the
    language model's hidden size: [S, context_dim] -> [S / merge_size**2, out_dim]."""

    def __init__(self, out_dim: int, context_dim: int, merge_size: int, eps: float = 1e-6, prefix: str = ""):
        super().__init__()
        self.hidden = context_dim * merge_size ** 2
        self.ln_q = RMSNorm(context_dim, eps)
        self.mlp = nn.ModuleList([
            ReplicatedLinear(self.hidden, self.hidden, bias=True, prefix=f"{prefix}.mlp.0"), nn.GELU(),
            ReplicatedLinear(self.hidden, out_dim, bias=True, prefix=f"{prefix}.mlp.2")])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).view(-1, self.hidden)
        for layer in self.mlp:
            x = layer(x)
        return x
