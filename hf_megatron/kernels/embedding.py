"""Embedding lookup whose weight gradient needs no host sync (csrc/embedding.cu), with PyTorch's
module as the fallback.

    lookup(module, ids) -> module.weight[ids]

PyTorch's CUDA embedding backward counts the distinct ids on the host, which makes every training
step wait, at the end of its backward, for the GPU to finish it: the optimizer and the next step
are then queued from behind, and the GPU idles while the host catches up.  Here the forward is
PyTorch's own gather; backward sorts the ids and finds each id's run on the device, then one kernel
sums each run's gradient rows in fp32, in sorted order (deterministic, like PyTorch's), rounded once
to the weight's dtype.  Used for a plain `nn.Embedding` (no padding_idx, max_norm,
scale_grad_by_freq or sparse) whose weight and input are on a CUDA device with the extension built.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .build import load_extension

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class SyncFreeEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.num_embeddings = weight.shape[0]
        return F.embedding(ids, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1]).contiguous()
        sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
        ends = torch.searchsorted(sorted_ids, sorted_ids, right=True)
        grad_weight = grad.new_zeros(ctx.num_embeddings, grad.shape[1])
        load_extension().embedding_backward(grad, sorted_ids, order.contiguous(), ends, grad_weight)
        return None, grad_weight


def _plain(module: nn.Module) -> bool:
    return (type(module) is nn.Embedding and module.padding_idx is None and module.max_norm is None
            and not module.scale_grad_by_freq and not module.sparse)


def lookup(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """module(ids), with the sync-free backward where it applies (see the module docstring)."""
    from . import _kernel_ready
    weight = getattr(module, "weight", None)
    if (_plain(module) and weight.dtype in _DTYPES and ids.device == weight.device and 0 < ids.numel() < 2 ** 31
            and torch.is_grad_enabled() and weight.requires_grad and not module._forward_hooks
            and not module._forward_pre_hooks and _kernel_ready(weight)):
        return SyncFreeEmbedding.apply(ids.long(), weight)
    return module(ids)
