"""LayerNorm and RMSNorm, computed the way transformers computes them (fp32 statistics)."""
from __future__ import annotations

import torch
from torch import nn

from .. import kernels


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps); statistics in fp32, cast back before the weight (as HF Llama)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)  # fused on CUDA; same expression elsewhere


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters, state-dict names and CPU numerics), fused on CUDA."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None or self.bias is None or len(self.normalized_shape) != 1:
            return super().forward(x)
        return kernels.layer_norm(x, self.weight, self.bias, self.eps)


def make_norm(config, dtype=None, device=None) -> nn.Module:
    if config.normalization == "RMSNorm":
        return RMSNorm(config.hidden_size, config.norm_epsilon, dtype=dtype, device=device)
    return LayerNorm(config.hidden_size, eps=config.norm_epsilon, dtype=dtype, device=device)
