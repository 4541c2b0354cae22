"""LayerNorm and RMSNorm, computed the way transformers computes them (fp32 statistics).

Zero-centred RMSNorm (Gemma; megatron-core's `layernorm_zero_centered_gamma`) stores w - 1:
    y = ((x32 / sqrt(mean(x32^2) + eps)) * (1 + w32)).to(x.dtype)
scaled in fp32 and cast once at the end, as transformers' Gemma (Llama casts before the weight).
"""
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


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm with weight w - 1 (initialised 0): y = (norm(x32) * (1 + w32)).to(x.dtype)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None, device=None):
        super().__init__(hidden_size, eps, dtype=dtype, device=device)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def make_norm(config, dtype=None, device=None, size: int | None = None) -> nn.Module:
    """config's norm over the last dim, `size` wide (default hidden_size; kv_channels for q/k norms)."""
    size = size or config.hidden_size
    if config.normalization == "RMSNorm":
        if config.layernorm_zero_centered_gamma:
            return ZeroCenteredRMSNorm(size, config.norm_epsilon, dtype=dtype, device=device)
        return RMSNorm(size, config.norm_epsilon, dtype=dtype, device=device)
    # PyTorch's own LayerNorm: on an H200 it beat a fused LayerNorm kernel of ours (0.76x forward,
    # 0.91x forward+backward, bench/RESULTS.md 2026-11-30), which was therefore deleted
    return nn.LayerNorm(size, eps=config.norm_epsilon, dtype=dtype, device=device)
