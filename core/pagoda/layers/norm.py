"""RMSNorm through the selected ``rms_norm`` / ``fused_add_rms_norm`` kernels.

``offset`` selects the norms whose weight multiplies in float32 before the one rounding to the
activation dtype (ops ``rms_norm_offset`` / ``fused_add_rms_norm_offset``): Gemma's ``(1 + w)``
norm is ``offset=1.0``, GPT-OSS's norm (float32 weights, ``params_dtype=torch.float32``) is
``offset=0.0``. Without it: Llama's norm, ``w * round(normalised x)``.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.kernels import get_op


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float | None = None,
                 params_dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype or torch.get_default_dtype()))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if self.offset is not None:
            if residual is None:
                return get_op("rms_norm_offset")(x, self.weight, self.eps, self.offset)
            return get_op("fused_add_rms_norm_offset")(x, residual, self.weight, self.eps, self.offset)
        if residual is None:
            return get_op("rms_norm")(x, self.weight, self.eps)
        return get_op("fused_add_rms_norm")(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        offset = f", offset={self.offset}" if self.offset is not None else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{offset}"
