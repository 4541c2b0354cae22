"""`accelerator.clip_grad_norm_` on a batch that only accumulates (`accelerator.sync_gradients` False).

Plain accelerate's clip_grad_norm_ is torch's on the gradients as they are: on such a batch the
partial sum g_acc = sum_{i<=j} grad(L_i / k) of this process (no_sync: not reduced), which it
also clips in place,

    n = ||g_acc||_2,   g_acc <- g_acc * min(1, max_norm / (n + 1e-6)),

so a script that clips on every batch (not only under `if accelerator.sync_gradients`) trains on
the clipped partial sums.  The engine keeps the same partial sums (this rank's grad buffer, before
the dp reduction), so the same norm and the same clip apply to them here.  The norm counts every
model-parallel shard once (the optimizer's own rule) and sums the parts a synced step would sum
first -- sequence-parallel params over tp, the tied embedding over its two pipeline stages -- on
copies; the scale is linear, so it goes on the parts themselves.

At dp > 1 each rank's buffer holds its share of the gradient of the global token mean (the dp
reduction is a sum), i.e. its own batch mean's gradient / dp when the ranks' batches hold equally
many scored tokens; plain accelerate's process holds its own batch mean's.  So the norm is dp x the
buffer's (plain's exactly under that condition) and the clip coefficient is taken from it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...parallel import pipeline, state
from ...parallel.data_parallel import allreduce_tensors
from ...training.optimizer import _counted_in_norm


def _summed_copies(params, grads, group, keep) -> dict[int, torch.Tensor]:
    """id(param) -> its gradient summed over `group` (a copy), for the params `keep` picks."""
    picked = [(p, g) for p, g in zip(params, grads) if keep(p)]
    if not picked or group is None or dist.get_world_size(group) == 1:
        return {}
    copies = [g.detach().float().clone() for _, g in picked]
    allreduce_tensors(copies, group)
    return {id(p): c for (p, _), c in zip(picked, copies)}


@torch.no_grad()
def clip_accumulated_(engine, max_norm: float) -> torch.Tensor:
    """Total L2 norm of the gradients accumulated since the last update (before clipping), after
    scaling them by min(1, max_norm / (norm + 1e-6)) in place, as torch.nn.utils.clip_grad_norm_."""
    optimizer, chunks = engine.optimizer, list(engine.chunks)
    params = optimizer.model_params
    grads = optimizer.grad_buffer.gradients(params)
    grid = state.get_state()
    summed = _summed_copies(params, grads, grid.group("tp"), lambda p: getattr(p, "sequence_parallel", False))
    tied = {id(p) for p in pipeline.tied_embedding_params(chunks)}
    summed.update(_summed_copies(params, grads, grid.group("embd"), lambda p: id(p) in tied))
    counted = {id(p) for c in chunks for n, p in c.named_parameters() if _counted_in_norm(c, n, p)}
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p, g in zip(params, grads):
        if id(p) in counted and g.numel():
            total += summed.get(id(p), g).double().pow(2).sum()
    group = grid.group("mp")
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    norm = (total.sqrt() * grid.dp).float()
    coeff = float(max_norm) / (float(norm) + 1e-6)
    if coeff < 1.0:
        torch._foreach_mul_([g for g in grads if g.numel()], coeff)
    return norm
