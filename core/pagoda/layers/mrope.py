"""Multimodal rotary embedding (M-RoPE, Qwen2-VL / Qwen2.5-VL).

Every token has three positions (temporal, height, width); text tokens have the same value in
all three. The head's rotary frequencies are split into ``mrope_section`` groups (summing to
rotary_dim / 2): group i takes its angle from position row ``i % 3``. The merged cos/sin rows
of a step are built once per forward and applied by the platform's ``rotary_embedding`` op.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.errors import ModelLoadError
from pagoda.kernels import get_op
from pagoda.layers.rotary import _base_inv_freq, _table


class MRotaryEmbedding(nn.Module):
    """forward(positions [3, T] or [T], q [T, nq*hs], k [T, nk*hs]) -> rotated (q, k)."""

    def __init__(self, head_size: int, max_position: int, rope_theta: float, mrope_section: list[int]):
        super().__init__()
        if sum(mrope_section) != head_size // 2:
            raise ModelLoadError(f"config rope_parameters.mrope_section {list(mrope_section)} sums to "
                                 f"{sum(mrope_section)}; it must sum to head_dim / 2 = {head_size // 2}")
        self.head_size = head_size
        self.section = [int(s) for s in mrope_section]
        # [max_position, head_size]: cos | sin of each position (the 1-D rotary layer's layout)
        self.register_buffer("cos_sin_cache", _table(_base_inv_freq(rope_theta, head_size), max_position, 1.0),
                             persistent=False)

    def merged_table(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [3, T] -> [T, head_size] cos | sin rows, each frequency group from its position row."""
        rows = self.cos_sin_cache[positions]  # [3, T, head_size]
        half = self.head_size // 2

        def pick(x: torch.Tensor) -> torch.Tensor:  # [3, T, half] -> [T, half]
            return torch.cat([part[i % 3] for i, part in enumerate(x.split(self.section, dim=-1))], dim=-1)

        return torch.cat((pick(rows[..., :half]), pick(rows[..., half:])), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module | None = None,
                k_norm: nn.Module | None = None):
        if positions.dim() == 1:  # text only: all three rows equal
            index, table = positions, self.cos_sin_cache
        else:
            table = self.merged_table(positions)
            index = torch.arange(table.shape[0], device=positions.device)
        if q_norm is not None and k_norm is not None:
            return get_op("qk_norm_rotary")(index, q, k, q_norm.weight, k_norm.weight, q_norm.eps, self.head_size,
                                            table, True)
        return get_op("rotary_embedding")(index, q, k, self.head_size, table, True)
