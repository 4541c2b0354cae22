"""Rotary position embeddings (non-interleaved "rotate half", as transformers and megatron-core).

    q' = q * cos(theta_p) + rotate_half(q) * sin(theta_p),  theta_p,i = p * inv_freq_i

`inv_freq_i = 1 / base^(2i/d)`, optionally rescaled: "linear" divides by `factor`; "llama3"
divides low frequencies by `factor`, keeps high ones and interpolates in between
(Llama 3.1's scheme, same formula as transformers' `_compute_llama3_parameters`).
"longrope" (Phi-3; "su" in older configs) has two sets of per-frequency factors:
    inv_freq_i = 1 / (factor_i * base^(2i/d)),  factor = long_factor if the sequence (max position
    + 1) exceeds original_max_position_embeddings else short_factor,
and scales cos and sin by `attention_factor` (transformers' `_compute_longrope_parameters`).
Partial rotary (`rotary_percent` < 1): only the first d = int(hn * rotary_percent) dims of
each head rotate; the rest pass through.
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
    if kind == "longrope":
        raise ValueError("longrope has two frequency sets: use longrope_inv_freqs")
    raise ValueError(f"unsupported rope type {kind!r}")


def longrope_inv_freqs(dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(short, long) inverse frequencies of longrope, as transformers computes them."""
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return tuple(1.0 / (torch.tensor(scaling[key], dtype=torch.float32, device="cpu") * base ** exponent)
                 for key in ("short_factor", "long_factor"))


class RotaryEmbedding(nn.Module):
    """cos/sin tables from position ids.  The inverse frequencies are computed on the CPU (not a
    buffer), so a model built on the meta device and materialised later needs no re-init."""

    def __init__(self, dim: int, base: float, scaling: dict | None = None):
        super().__init__()
        self.long_inv_freq, self.long_after, self.attention_factor = None, None, 1.0
        self._device_copies: dict[tuple[str, torch.device], torch.Tensor] = {}  # _on's copies
        if scaling and scaling.get("rope_type") == "longrope":
            self.inv_freq, self.long_inv_freq = longrope_inv_freqs(dim, base, scaling)
            self.long_after = scaling["original_max_position_embeddings"]
            self.attention_factor = scaling["attention_factor"]
        else:
            self.inv_freq = rope_inv_freq(dim, base, scaling)

    def _on(self, device: torch.device, name: str) -> torch.Tensor:
        """The CPU table `name` on `device`, copied once per device: a host tensor copied to the GPU in
        every forward is a blocking copy each step (the host waits for everything queued before it)."""
        key = (name, device)
        if key not in self._device_copies:
            self._device_copies[key] = getattr(self, name).to(device)
        return self._device_copies[key]

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [b, s, d] for position_ids [b, s]."""
        inv_freq = self._on(position_ids.device, "inv_freq")
        if self.long_inv_freq is not None:  # one set for the whole batch, by its longest sequence
            inv_freq = torch.where(position_ids.max() + 1 > self.long_after,
                                   self._on(inv_freq.device, "long_inv_freq"), inv_freq)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, s, hn]; cos/sin: [b, s, d], d <= hn.  x * cos + rotate_half(x) * sin on the
    first d dims (fused on CUDA); the other hn - d pass through."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return kernels.apply_rotary(x, cos, sin)
    return torch.cat([kernels.apply_rotary(x[..., :d], cos, sin), x[..., d:]], dim=-1)
