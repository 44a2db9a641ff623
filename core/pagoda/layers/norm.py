"""RMSNorm through the selected ``rms_norm`` / ``fused_add_rms_norm`` kernels."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.kernels import get_op


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return get_op("rms_norm")(x, self.weight, self.eps)
        return get_op("fused_add_rms_norm")(x, residual, self.weight, self.eps)
