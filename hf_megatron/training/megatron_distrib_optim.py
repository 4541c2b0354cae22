"""Megatron-LM's distrib_optim.pt (megatron-core 0.16.1 DistributedOptimizer, --ckpt-format torch) read
into our parameter state (optimizer_state.py).

What Megatron-LM's `save_checkpoint` writes there (torch format): `optimizer.save_parameter_state(file)`,
i.e. `DistributedOptimizer.get_parameter_state_dp_zero()` gathered onto dp rank 0:

    {"buckets_coalesced": True,
     b: {(param_dtype, grad_dtype): {"param", "exp_avg", "exp_avg_sq": fp32 [n_b], "numel_unpadded": n_b}}}

one entry b per grad buffer (per model chunk, one buffer per param dtype in order of first appearance,
expert-parallel params excluded: they are a second optimizer and the file is then a list).  Each
tensor is the buffer's world view without the padding at the end of each bucket -- and nothing else
removed, so a param's position depends on megatron-core's buffer layout (`_ParamAndGradBuffer`):

* the buffer's params are `named_parameters()` (requires_grad) of the chunk in REVERSE order;
* every param starts at a multiple of 64 within its bucket (buckets start 128-aligned);
* a bucket closes after the param whose end reaches `bucket_size` elements from the bucket start,
  and a word embedding tied across pipeline stages (`shared_embedding`) gets a bucket of its own
  (the bucket before it then ends at its 64-aligned start);
* in the file, bucket k+1 follows bucket k's unpadded length directly.

`bucket_size` is Megatron-LM's (`get_model` + `DistributedDataParallel`): None without
--overlap-grad-reduce, for model chunks after the first, and on pipeline stages after the first;
else --ddp-bucket-size, or (all params of the rank) // --ddp-num-buckets, or
max(4e7, 1e6 * dp * cp).  All of these come from the `args` of model_optim_rng.pt.  The layout is
rebuilt from our own params (same names, shapes, dtypes and megatron-core's module order,
megatron_optimizer_layout.megatron_module_order) and every buffer's length checked against the
file's `numel_unpadded`: a mismatch is one CheckpointError naming the file.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CheckpointError
from ..parallel import pipeline
from .megatron_optimizer_layout import inner_state, megatron_module_order
from .optimizer_state import MOMENTS

PARAM_ALIGN = 64  # _pad_start_of_param_if_needed


def is_megatron_distrib_optim(ps) -> bool:
    """megatron-core's dp_zero layout (or a ChainedOptimizer's list of them), not ours."""
    if isinstance(ps, list):
        return True
    return isinstance(ps, dict) and "numels" not in ps and ("buckets_coalesced" in ps or 0 in ps)


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module") and not hasattr(module, "config"):
        module = module.module
    return module


def bucket_size_of(args, chunk_index: int, pp_rank: int, rank_numel: int) -> int | None:
    """Megatron-LM's bucket size for one model chunk (see the module docstring)."""
    if not getattr(args, "overlap_grad_reduce", False) or chunk_index > 0 or pp_rank > 0 \
            or getattr(args, "overlap_param_gather_with_optimizer_step", False):
        return None
    if getattr(args, "ddp_num_buckets", None):
        return rank_numel // int(args.ddp_num_buckets)
    if getattr(args, "ddp_bucket_size", None):
        return int(args.ddp_bucket_size)
    dp = int(getattr(args, "data_parallel_size", 1) or 1) * int(getattr(args, "context_parallel_size", 1) or 1)
    return max(40_000_000, 1_000_000 * dp)


def buffer_layout(params: list[torch.Tensor], bucket_size: int | None, alone: set[int]) -> tuple[dict[int, int], int]:
    """({id(param): offset in the file's coalesced tensor}, its length) for one grad buffer whose
    params are `params` in named_parameters order; `alone`: ids of shared-embedding params."""
    offsets, world, cursor, open_bucket = {}, 0, 0, False
    for p in reversed(params):
        start = -(-cursor // PARAM_ALIGN) * PARAM_ALIGN
        if id(p) in alone and open_bucket:  # the previous bucket ends at this param's aligned start
            world, start = world + start, 0
        offsets[id(p)] = world + start
        end, open_bucket = start + p.numel(), True
        if (bucket_size is not None and end >= bucket_size) or id(p) in alone:
            world, cursor, open_bucket = world + end, 0, False
        else:
            cursor = end
    return offsets, world + (cursor if open_bucket else 0)


def megatron_buffers(chunks) -> list[tuple[int, torch.dtype, list[torch.Tensor]]]:
    """(chunk index, param dtype, params in megatron-core's named_parameters order) per grad buffer."""
    out = []
    for c, chunk in enumerate(chunks):
        named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad]
        ordered = [named[i][1] for i in megatron_module_order([n for n, _ in named])]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in ordered:
            by_dtype.setdefault(p.dtype, []).append(p)
        out.extend((c, dtype, params) for dtype, params in by_dtype.items())
    return out


def parameter_state_from_megatron(ps, optimizer_entry: dict, chunks, model_params: list[torch.Tensor], args,
                                  pp_rank: int, path: Path) -> dict:
    """megatron-core's distrib_optim.pt (`ps`, from `path`) + the optimizer entry of model_optim_rng.pt
    (its groups carry the step) -> our parameter state for `model_params`."""
    if isinstance(ps, list):
        raise CheckpointError(f"{path}: holds {len(ps)} distributed optimizers' states (megatron-core's "
                              f"ChainedOptimizer: expert-parallel or per-group optimizers); one is supported")
    if not ps.get("buckets_coalesced"):
        raise CheckpointError(f"{path}: megatron-core's legacy per-bucket distrib_optim.pt layout (no "
                              f"'buckets_coalesced'); re-save it with megatron-core >= 0.8")
    chunks = [_unwrap(c) for c in chunks]
    rank_numel = sum(p.numel() for c in chunks for p in c.parameters())
    alone = {id(p) for p in pipeline.tied_embedding_params(chunks)}
    buffers = megatron_buffers(chunks)
    saved = sorted(k for k in ps if k != "buckets_coalesced")
    if saved != list(range(len(buffers))):
        raise CheckpointError(f"{path}: grad buffers {saved} saved, this model has {len(buffers)} "
                              f"(one per model chunk and param dtype)")
    where: dict[int, tuple[dict, int]] = {}
    for b, (c, dtype, params) in enumerate(buffers):
        entry = ps[b]
        if not isinstance(entry, dict) or len(entry) != 1:
            raise CheckpointError(f"{path}: grad buffer {b} should hold one (param dtype, grad dtype) entry")
        (key, tensors), = entry.items()
        if not isinstance(key, tuple) or key[0] != dtype:
            raise CheckpointError(f"{path}: grad buffer {b} saved for {key}, this model's params are {dtype}")
        offsets, total = buffer_layout(params, bucket_size_of(args, c, pp_rank, rank_numel), alone)
        for name in ("param", *MOMENTS):
            t = tensors.get(name) if isinstance(tensors, dict) else None
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != total:
                raise CheckpointError(f"{path}: grad buffer {b} {name} should be a 1-D tensor of {total} elements "
                                      f"(megatron-core's layout of this model's {len(params)} {dtype} params), got "
                                      f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if tensors.get("numel_unpadded", total) != total:
            raise CheckpointError(f"{path}: grad buffer {b} numel_unpadded {tensors['numel_unpadded']}, this model's "
                                  f"layout has {total}")
        for p in params:
            where[id(p)] = (tensors, offsets[id(p)])
    flat = {key: [] for key in ("param", *MOMENTS)}
    for i, p in enumerate(model_params):
        if id(p) not in where:
            raise CheckpointError(f"{path}: optimizer param {i} ({tuple(p.shape)}) is in no grad buffer of the model")
        tensors, at = where[id(p)]
        for key in flat:
            flat[key].append(tensors[key][at:at + p.numel()].float().cpu())
    # DistributedOptimizer.state_dict() drops each group's "params" and keeps the step per group
    steps = {int(g["step"]) for g in inner_state(optimizer_entry)["param_groups"] if g.get("step") is not None}
    if len(steps) > 1:
        raise CheckpointError(f"{path}: the optimizer entry's param groups disagree on the step: {sorted(steps)}")
    step = steps.pop() if steps else 0
    return {"numels": [p.numel() for p in model_params], "step": step,
            **{k: torch.cat(v) if v else torch.zeros(0) for k, v in flat.items()}}
