"""Autograd-aware collectives over the tensor-parallel group.

Each pair is a forward op and its transpose as the backward:

    copy_to_tp        f(x) = x                    df = all-reduce(dy)
    reduce_from_tp    f(x) = all-reduce(x)        df = dy
    scatter_to_tp     f(x) = x[..., chunk r]      df = all-gather(dy, last dim)
    gather_from_tp    f(x) = cat_r(x_r, last)     df = dy[..., chunk r]
    sp_gather         f(x) = cat_r(x_r, dim 0)    df = reduce-scatter(dy, dim 0)   (sequence parallel)
    sp_reduce_scatter f(x) = reduce-scatter(x, 0) df = all-gather(dy, dim 0)
    sp_scatter        f(x) = x[chunk r, ...]      df = all-gather(dy, dim 0)

With tp == 1 every op is the identity. Sequence-parallel ops split along dim 0
(activations are [s, b, h] in the sequence-parallel region, as in Megatron).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import state


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    if state.tp_size() == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=state.tp_group())
    return x


def _gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    size = state.tp_size()
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=state.tp_group())
    return torch.cat(parts, dim=dim)


def _split(x: torch.Tensor, dim: int) -> torch.Tensor:
    size = state.tp_size()
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by tp={size}")
    return x.chunk(size, dim=dim)[state.tp_rank()].contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int) -> torch.Tensor:
    size = state.tp_size()
    if size == 1:
        return x
    # all-reduce + split: gloo has no reduce_scatter; NCCL users pay one extra copy only
    if dist.get_backend(state.tp_group()) == "nccl" and dim == 0:
        out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x.contiguous(), group=state.tp_group())
        return out
    return _split(_all_reduce(x.clone()), dim)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone())


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        ctx.dim = dim
        return _split(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        ctx.dim = dim
        return _gather(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim), None


class _SPGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather(x, 0)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 0)


class _SPReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _reduce_scatter(x, 0)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0)


def copy_to_tp(x: torch.Tensor) -> torch.Tensor:
    return x if state.tp_size() == 1 else _CopyToTP.apply(x)


def reduce_from_tp(x: torch.Tensor) -> torch.Tensor:
    return x if state.tp_size() == 1 else _ReduceFromTP.apply(x)


def scatter_to_tp(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return x if state.tp_size() == 1 else _ScatterToTP.apply(x, dim)


def gather_from_tp(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return x if state.tp_size() == 1 else _GatherFromTP.apply(x, dim)


def sp_gather(x: torch.Tensor) -> torch.Tensor:
    return x if state.tp_size() == 1 else _SPGather.apply(x)


def sp_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    return x if state.tp_size() == 1 else _SPReduceScatter.apply(x)


def sp_scatter(x: torch.Tensor) -> torch.Tensor:
    """Keep this rank's sequence chunk (dim 0); backward all-gathers."""
    return x if state.tp_size() == 1 else _ScatterToTP.apply(x, 0)
