"""Data parallelism: split the global batch, sum gradients over the dp group, ZeRO-1.

Global batch B = micro_batch_size x num_micro_batches x dp.  Like Megatron's pretraining
sampler, every block of `micro_batch_size x dp` consecutive samples gives each dp rank one
micro batch (rank r takes rows [r*mbs, (r+1)*mbs) of the block).

The step's loss is  L = sum_tokens loss / N_global,  where N_global counts the target tokens of
the whole global batch (all micro batches on all dp ranks).  Each rank back-propagates its local
sum scaled by 1/N_global, so the gradient of L is the plain SUM of the dp ranks' gradients:
`allreduce_grads` sums (no averaging), in a few large flat buckets so that many small tensors
cost a handful of collectives.  (The reduction runs after the last micro batch's backward;
overlapping it with backward is a speed optimisation, not a numerical one.)

ZeRO-1 (`ZeroShards`): the optimizer state is sharded over dp.  Parameters are dealt to dp ranks
whole (largest first onto the least loaded rank, a deterministic order every rank computes
identically); each rank runs the optimizer only on its own parameters, then every parameter
is broadcast from its owner, so all ranks end the step with identical weights.  Since Adam is
elementwise per parameter, the result is bit-identical to the unsharded optimizer.

Why not torch's DDP / ZeroRedundancyOptimizer: DDP averages (we need a plain sum after the global
token normalisation) and reduces `.grad` inside every backward, while we accumulate all micro
batches of a pipeline schedule into fp32 `main_grad` buffers and reduce once; and
ZeroRedundancyOptimizer shards only the inner optimizer, so the fp32 main weights of a bf16/fp16
model would stay replicated -- ours live only on the owning rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from . import state

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


def allreduce_grads(params, group=None) -> None:
    """Sum the gradients of `params` over the data-parallel group (default: this rank's)."""
    group = state.get_state().group("dp") if group is None else group
    allreduce_tensors([g for g in (grad_of(p) for p in params) if g is not None], group)


class ZeroShards:
    """Which dp rank owns (steps and broadcasts) each parameter, for ZeRO-1."""

    def __init__(self, params: list[torch.Tensor], group=None, group_ranks: list[int] | None = None) -> None:
        st = state.get_state()
        self.group = st.group("dp") if group is None else group
        self.group_ranks = group_ranks if group_ranks is not None else st.ranks.get("dp", [st.rank])
        self.size = len(self.group_ranks)
        self.rank = self.group_ranks.index(st.rank) if self.size > 1 else 0
        load = [0] * self.size
        self.owner: dict[int, int] = {}
        order = sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))
        for i in order:
            target = min(range(self.size), key=lambda r: (load[r], r))
            self.owner[i] = target
            load[target] += params[i].numel()
        self.params = params

    def owns(self, index: int) -> bool:
        return self.owner[index] == self.rank

    @torch.no_grad()
    def broadcast(self, tensors: list[torch.Tensor] | None = None) -> None:
        """Every tensor (aligned with the params) from its owner to the other dp ranks."""
        if self.size == 1:
            return
        tensors = self.params if tensors is None else tensors
        for owner in range(self.size):
            owned = [t for i, t in enumerate(tensors) if self.owner[i] == owner]
            if not owned:
                continue
            flat = _flatten_dense_tensors(owned)
            dist.broadcast(flat, src=self.group_ranks[owner], group=self.group)
            if owner != self.rank:
                for dst, src in zip(owned, _unflatten_dense_tensors(flat, owned)):
                    dst.copy_(src)
