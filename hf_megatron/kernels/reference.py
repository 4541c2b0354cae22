"""Pure-PyTorch forms of the fused ops: what the model computes on CPU, and the CUDA fallback.

These are exactly the expressions hf_megatron.model used before the kernels existed (and that
transformers uses), op for op, so the CPU path is bitwise unchanged:

    rms_norm(x, w, eps)    = w * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype),   x32 = x.float()
    swiglu([gate; up])     = silu(gate) * up,   silu(g) = g * sigmoid(g)
    apply_rotary(x, c, s)  = x * c + rotate_half(x) * s,   rotate_half(x) = [-x2, x1]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(input_dtype)


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, s, d]; cos/sin: [b, s, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def cross_entropy_reference(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                            ignore_index: int) -> torch.Tensor:
    """Per-row fp32 cross entropy over the first `vocab_size` columns; logits [rows, V_padded]."""
    return F.cross_entropy(logits[..., :vocab_size].float(), targets, ignore_index=ignore_index, reduction="none")
