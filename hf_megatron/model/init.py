"""Megatron-style initial weights, one full tensor at a time.

normal(0, std) for matrices and embeddings; output projections (linear_proj, linear_fc2) with
std / sqrt(2 * num_layers); zero biases; unit norm weights (zero where the norm is zero-centred).  Each tensor draws from its own
generator, seeded from (seed, its full-model name), so a rank draws only the tensors it holds,
yet every layout (any TP/PP split) starts from the same weights as one process.  Vocabulary
tables are drawn for `vocab_size` rows; the padding rows stay zero.
"""
from __future__ import annotations

import math
import zlib

import torch


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))


def init_tensor(name: str, shape: tuple[int, ...], config, seed: int = 1234) -> torch.Tensor:
    """The initial value (fp32, CPU) of full-model tensor `name` of full `shape`."""
    if name.endswith("bias"):
        return torch.zeros(shape)
    if "layernorm" in name or name.endswith("norm.weight"):
        # a zero-centred norm stores w - 1: zero is the unit scale
        return torch.zeros(shape) if config.layernorm_zero_centered_gamma else torch.ones(shape)
    std = config.init_method_std
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std = std / math.sqrt(2.0 * config.num_layers)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        out = torch.zeros(shape)
        rows = min(config.vocab_size, shape[0])
        out[:rows] = torch.randn((rows,) + tuple(shape[1:]), generator=_generator(seed, name)) * std
        return out
    return torch.randn(shape, generator=_generator(seed, name)) * std
