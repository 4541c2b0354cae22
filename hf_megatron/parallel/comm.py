"""Autograd-aware collectives over a tensor-parallel group.

Each pair is a forward op and its transpose as the backward:

    copy_to_tp        f(x) = x                    df = all-reduce(dy)
    reduce_from_tp    f(x) = all-reduce(x)        df = dy
    scatter_to_tp     f(x) = x[..., chunk r]      df = all-gather(dy, last dim)
    gather_from_tp    f(x) = cat_r(x_r, last)     df = dy[..., chunk r]
    sp_gather         f(x) = cat_r(x_r, dim 0)    df = reduce-scatter(dy, dim 0)   (sequence parallel)
    sp_reduce_scatter f(x) = reduce-scatter(x, 0) df = all-gather(dy, dim 0)
    sp_scatter        f(x) = x[chunk r, ...]      df = all-gather(dy, dim 0)

Every op takes the group explicitly (the parallel modules hold theirs); a group of None or of
size 1 makes every op the identity.  Sequence-parallel ops split along dim 0 (activations are
[s, b, h] in the sequence-parallel region, as in Megatron).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def reduce_scatter_flat(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False):
    """out = shard `rank` of the sum of every rank's `x` (dim 0): `reduce_scatter_single` where torch has
    it (2.13 deprecates the older name), `reduce_scatter_tensor` before."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, x, group=group, async_op=async_op)


def all_gather_flat(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False):
    """out = every rank's `x` concatenated (dim 0): `all_gather_single` where torch has it,
    `all_gather_into_tensor` before."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, x, group=group, async_op=async_op)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = group_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by tp={size}")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    # NCCL has reduce_scatter; gloo does not, so there it is an all-reduce + split
    if dist.get_backend(group) == "nccl" and dim == 0:
        size = group_size(group)
        out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        reduce_scatter_flat(out, x.contiguous(), group)
        return out
    return _split(_all_reduce(x.clone(), group), dim, group)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class _SPGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 0, ctx.group), None


class _SPReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0, ctx.group), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, dim, group)


def gather_from_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, dim, group)


def sp_gather(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _SPGather.apply(x, group)


def column_input(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The input of a column-parallel matmul: all-gathered along the sequence (backward
    reduce-scatters) with sequence parallelism, else replicated (backward all-reduces)."""
    return sp_gather(x, group) if sequence_parallel else copy_to_tp(x, group)


def sp_reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _SPReduceScatter.apply(x, group)


def sp_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's sequence chunk (dim 0); backward all-gathers."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, 0, group)
