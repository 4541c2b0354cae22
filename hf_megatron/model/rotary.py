"""Rotary position embeddings (non-interleaved "rotate half", as transformers and megatron-core).

    q' = q * cos(theta_p) + rotate_half(q) * sin(theta_p),  theta_p,i = p * inv_freq_i

`inv_freq_i = 1 / base^(2i/d)`, optionally rescaled: "linear" divides by `factor`; "llama3"
divides low frequencies by `factor`, keeps high ones and interpolates in between
(Llama 3.1's scheme, same formula as transformers' `_compute_llama3_parameters`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .. import kernels
from ..kernels import rotate_half  # noqa: F401  (kept importable from here)


def rope_inv_freq(dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "default":
        return inv_freq
    raise ValueError(f"unsupported rope type {kind!r}")


class RotaryEmbedding(nn.Module):
    """cos/sin tables from position ids.  The inverse frequencies are computed on the CPU (not a
    buffer), so a model built on the meta device and materialised later needs no re-init."""

    def __init__(self, dim: int, base: float, scaling: dict | None = None):
        super().__init__()
        self.inv_freq = rope_inv_freq(dim, base, scaling)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [b, s, d] for position_ids [b, s]."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, s, d]; cos/sin: [b, s, d].  x * cos + rotate_half(x) * sin (fused on CUDA)."""
    return kernels.apply_rotary(x, cos, sin)
