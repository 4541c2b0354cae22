"""Fused ops with exact PyTorch fallbacks: `rms_norm`, `swiglu`, `apply_rotary` (and the vocab
loss's cross entropy, kernels/cross_entropy.py).

Each op runs the CUDA kernel from csrc/ when its input is a CUDA tensor that the kernel
handles (float32/float16/bfloat16, matching dtypes) and the extension builds; otherwise, and
always on CPU, it runs the PyTorch expression in reference.py that the model has always used.
`HF_MEGATRON_KERNELS=0` forces the fallbacks.  Inside torch.compile, SwiGLU stays the csrc kernel
(a torch.library custom op, kernels/ops.py: inductor's own lowering of its backward reads twice
as much); RMSNorm and rotary fall back to the expressions, which inductor fuses with the residual
add and the attention layout.  A failed build warns once per process, then falls back.
"""
from __future__ import annotations

import torch

from .build import enabled, load_extension, loaded
from .reference import apply_rotary_reference, rms_norm_reference, rotate_half, swiglu_reference

__all__ = ["rms_norm", "swiglu", "apply_rotary", "rotate_half", "kernels_available", "enabled",
           "load_extension"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and getattr(compiler, "is_compiling", lambda: False)())


def _kernel_ready(x: torch.Tensor, compilable: bool = False) -> bool:
    """The csrc kernel can take x; `compilable` ops (kernels/ops.py) also inside torch.compile, once
    the extension is loaded: a first load traced by dynamo (the build's file checks and hashing)
    would graph-break the region, so there it falls back (apply_compile's regions load it before
    their first CUDA call)."""
    if not (x.is_cuda and x.dtype in _KERNEL_DTYPES and x.numel() > 0 and enabled()):
        return False
    if _compiling():
        return compilable and loaded() and load_extension() is not None
    return load_extension() is not None


def kernels_available() -> bool:
    """True when CUDA is present, the kernels are enabled and the extension is built."""
    return torch.cuda.is_available() and enabled() and load_extension() is not None


def _norm_weight_fits(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    return (weight is not None and weight.dtype == x.dtype and weight.device == x.device and weight.dim() == 1
            and x.dim() >= 1 and x.shape[-1] == weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2, -1) + eps)) with fp32 statistics; x [..., h], weight [h]."""
    if _norm_weight_fits(x, weight) and _kernel_ready(x):
        from .functions import FusedRMSNorm
        return FusedRMSNorm.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate; up] on the last dim ([..., 2f] -> [..., f])."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dim must be even ([gate; up] halves), got shape {tuple(x.shape)}")
    if _kernel_ready(x, compilable=True):
        from . import ops
        return ops.swiglu(x)
    return swiglu_reference(x)


def _rotary_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if x.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    batch, heads, seq, dim = x.shape
    return (cos.shape[0] in (1, batch) and tuple(cos.shape[1:]) == (seq, dim) and dim % 2 == 0
            and batch <= 65535 and heads <= 65535  # CUDA grid z / y limits
            and cos.dtype == sin.dtype == x.dtype and cos.device == sin.device == x.device
            and not (cos.requires_grad or sin.requires_grad))  # the kernel returns no cos/sin grads


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin; x [b, heads, s, d], cos/sin [b (or 1), s, d]."""
    if _rotary_fits(x, cos, sin) and _kernel_ready(x):
        from .functions import FusedRotary
        return FusedRotary.apply(x, cos, sin)
    return apply_rotary_reference(x, cos, sin)
