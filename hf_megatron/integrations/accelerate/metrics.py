"""accelerate's `gather` / `gather_for_metrics` / `reduce` under Megatron-LM: over the data-parallel
group, as plain accelerate runs them over its processes (the tensor / pipeline ranks of one replica
hold the same values).  At dp 1 they are plain accelerate's one process (DistributedType.NO): the
input itself -- a 0-d tensor stays 0-d, an object is not flattened, an integer tensor stays integer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate.utils import recursively_apply

from ...parallel import state


def _dp_group():
    group = state.get_state().group("dp")
    return group, (dist.get_world_size(group) if group is not None else 1)


def gather(tensor):
    group, size = _dp_group()
    if size == 1:
        return recursively_apply(lambda t: t, tensor, error_on_other_type=True)

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()[None] if t.ndim == 0 else t.contiguous()
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t, group=group)
        return torch.cat(parts)

    return recursively_apply(one, tensor, error_on_other_type=True)


def gather_object(obj):
    group, size = _dp_group()
    if size == 1:
        return obj
    parts = [None] * size
    dist.all_gather_object(parts, obj, group=group)
    return [item for part in parts for item in part]  # accelerate's gather_object flattens one level


def gather_for_metrics(input_data, use_gather_object: bool, gradient_state):
    """accelerate's: objects (or anything not all tensors) by gather_object, tensors by gather; at the end of
    a loader the duplicates even_batches added to its last batch (`gradient_state.remainder`) are dropped."""
    try:
        recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        tensors_only = True
    except TypeError:
        tensors_only = False
    use_gather_object = use_gather_object or not tensors_only
    data = gather_object(input_data) if use_gather_object else gather(input_data)
    remainder = gradient_state.remainder
    if not gradient_state.end_of_dataloader or remainder <= 0:
        return data
    try:  # accelerate's: what cannot be cut (a 0-d tensor, ...) is returned whole
        return data[:remainder] if use_gather_object else recursively_apply(lambda t: t[:remainder], data)
    except Exception:
        return data


def reduce(tensor, reduction: str = "sum"):
    """"sum", "mean" or "max" over the data-parallel group."""
    group, size = _dp_group()

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        if size == 1:
            return t
        dist.all_reduce(t, op=dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM, group=group)
        if reduction == "mean":
            t /= size  # in place, as accelerate's (an integer tensor's mean is an error there too)
        return t

    return recursively_apply(one, tensor, error_on_other_type=True)
