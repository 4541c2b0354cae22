"""autograd Functions over the CUDA extension (hf_megatron/kernels/build.py loads it); SwiGLU is a
torch.library custom op instead (ops.py).

Each saves the least that its backward needs:
  RMSNorm: x, weight and the fp32 per-row 1/rms (recomputing x_hat in backward);
  rotary:  only cos and sin (the map is linear in x).
Backward is not itself differentiable (no double backward), as for megatron-core's fused ops.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .build import load_extension


class FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        weight = weight.contiguous()
        y, rstd = load_extension().rms_norm_forward(rows, weight, float(eps))
        ctx.save_for_backward(rows, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        rows, weight, rstd = ctx.saved_tensors
        dx, dw = load_extension().rms_norm_backward(dy.reshape(rows.shape).contiguous(), rows, weight, rstd)
        return dx.view(ctx.shape), dw, None


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class FusedRotary(torch.autograd.Function):
    """cos/sin are constants here (the dispatcher sends tensors that need their grads elsewhere)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return load_extension().rotary_forward(_last_dim_contiguous(x), cos, sin)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return load_extension().rotary_backward(_last_dim_contiguous(dy), cos, sin), None, None
