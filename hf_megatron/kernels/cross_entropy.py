"""Fused cross entropy (csrc/cross_entropy.cu) for the TP=1 vocab loss, with the PyTorch fallback.

    cross_entropy(logits [rows, V_padded], targets [rows], vocab_size, ignore_index, grad_into_logits)
        -> fp32 per-row losses (0 where target == ignore_index)

PyTorch computes `F.cross_entropy(logits[:, :V].float(), ...)` in passes over an fp32 copy of the
logits (the copy, the log-softmax, and in backward the log-softmax gradient and the cast back); the
kernel reads the bf16 row once for the loss (an online max and sum of exponentials, saving the
per-row log-sum-exp) and once more in backward, writing the gradient rounded once to the logits'
dtype.  `grad_into_logits=True` writes that gradient into the logits' own buffer, so the backward
peak holds one [rows, V] tensor instead of two -- for a caller that does not use the logits after
the loss (GPTModel without return_logits).  The write bumps the logits' version counter, so
autograd raises (instead of computing with overwritten values) if anything else saved them.

Kept outside torch.compile (`torch.compiler.disable`): the loss region then runs this kernel eagerly,
which beats what inductor fuses of the PyTorch expression.  Backward is not differentiable again.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import _kernel_ready
from .build import load_extension
from .reference import cross_entropy_reference

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_size: int, ignore_index: int, grad_into_logits: bool):
        loss, lse = load_extension().cross_entropy_forward(logits, targets, vocab_size, ignore_index)
        ctx.save_for_backward(logits, targets, lse)
        ctx.vocab_size, ctx.ignore_index, ctx.grad_into_logits = vocab_size, ignore_index, grad_into_logits
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        out = None
        if ctx.grad_into_logits:
            out = logits
            torch.autograd.graph.increment_version(logits)
        dz = load_extension().cross_entropy_backward(grad.float(), logits, targets, lse, ctx.vocab_size,
                                                     ctx.ignore_index, out)
        return dz, None, None, None, None


def kernel_fits(logits: torch.Tensor, targets: torch.Tensor) -> bool:
    """The csrc kernel takes these tensors (CUDA, a float dtype, [rows, V] with V contiguous)."""
    return (logits.is_cuda and logits.dtype in _DTYPES and logits.dim() == 2 and logits.stride(-1) == 1
            and targets.device == logits.device and 0 < logits.shape[0] < 2 ** 31)


@torch.compiler.disable
def _fused(logits, targets, vocab_size, ignore_index, grad_into_logits):
    return FusedCrossEntropy.apply(logits.contiguous(), targets.long().contiguous(), vocab_size, ignore_index,
                                   grad_into_logits)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, ignore_index: int,
                  grad_into_logits: bool = False) -> torch.Tensor:
    """fp32 per-row cross entropy of logits [rows, V_padded] over their first `vocab_size` columns."""
    if kernel_fits(logits, targets) and _kernel_ready(logits, compilable=True):
        return _fused(logits, targets, vocab_size, ignore_index, grad_into_logits)
    return cross_entropy_reference(logits, targets, vocab_size, ignore_index)
