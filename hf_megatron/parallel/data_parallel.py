"""Data parallelism: split the global batch; gradients are summed over dp, not averaged.

Global batch B = micro_batch_size x num_micro_batches x dp.  Like Megatron's pretraining
sampler, every block of `micro_batch_size x dp` consecutive samples gives each dp rank one
micro batch (rank r takes rows [r*mbs, (r+1)*mbs) of the block).

The step's loss is  L = sum_tokens loss / N_global,  where N_global counts the target tokens of
the whole global batch (all micro batches on all dp ranks).  Each rank back-propagates its local
sum scaled by 1/N_global, so the gradient of L is the plain SUM of the dp ranks' gradients.
That sum runs on the contiguous fp32 grad buffer in buckets (grad_buffer.py; all-reduce, or
reduce-scatter for the distributed optimizer in training/distributed_optimizer.py), with
`--overlap-grad-reduce` launched during the last micro batch's backward.

`allreduce_tensors` is the small packed all-reduce for what is summed over other groups after
that (sequence-parallel grads over TP).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

BUCKET_BYTES = 32 * 1024 * 1024


def micro_batches_for_rank(batch: dict, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> list[dict]:
    """The global batch (dict of [B, ...] tensors) -> this dp rank's list of micro batches."""
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise ValueError("batch has no tensors (expected input_ids / labels of shape [B, s])")
    size = next(iter(tensors.values())).shape[0]
    block = micro_batch_size * dp_size
    if size % block:
        raise ValueError(f"global batch of {size} samples is not divisible by "
                         f"micro_batch_size ({micro_batch_size}) x data-parallel size ({dp_size})")
    out = []
    for start in range(0, size, block):
        lo = start + dp_rank * micro_batch_size
        out.append({k: v[lo: lo + micro_batch_size] for k, v in tensors.items()})
    return out


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The tensor that holds p's accumulated gradient: fp32 `main_grad` (mixed precision) or `.grad`."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def allreduce_tensors(tensors: list[torch.Tensor], group, bucket_bytes: int = BUCKET_BYTES) -> None:
    """In-place SUM over `group`, packing same-dtype tensors into flat buckets."""
    if group is None or dist.get_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        bucket, size = [], 0
        for t in same + [None]:
            if t is not None:
                bucket.append(t)
                size += t.numel() * t.element_size()
            if bucket and (t is None or size >= bucket_bytes):
                flat = _flatten_dense_tensors(bucket)
                dist.all_reduce(flat, group=group)
                for dst, src in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    dst.copy_(src)
                bucket, size = [], 0
