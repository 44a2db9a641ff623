"""Gated activations: ``act(gate) * up`` over a [T, 2I] input."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.errors import ModelLoadError
from pagoda.kernels import get_op

_GATED = {"silu": "silu_and_mul", "swish": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul",
          "gelu_tanh": "gelu_tanh_and_mul"}


class GatedActivation(nn.Module):
    def __init__(self, hidden_act: str = "silu"):
        super().__init__()
        if hidden_act not in _GATED:
            raise ModelLoadError(f"config hidden_act={hidden_act!r} is not supported "
                                 f"(supported: {', '.join(sorted(_GATED))})")
        self.op = _GATED[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return get_op(self.op)(x)


SiluAndMul = GatedActivation
