"""megatron-core 0.16.1's DistributedOptimizer `distrib_optim.pt` (--ckpt-format torch): its layout, read into
our parameter state (optimizer_state.py) and written from our distributed optimizer.

What Megatron-LM's `save_checkpoint` writes there (torch format): `optimizer.save_parameter_state(file)`,
i.e. `DistributedOptimizer.get_parameter_state_dp_zero()` gathered onto dp rank 0:

    {"buckets_coalesced": True,
     b: {(param_dtype, grad_dtype): {"param", "exp_avg", "exp_avg_sq": fp32 [n_b], "numel_unpadded": n_b}}}

one entry b per grad buffer (per model chunk, one buffer per param dtype in order of first appearance,
expert-parallel params excluded: they are a second optimizer and the file is then a list).  The grad
dtype is fp32 for fp32 and bf16 params (Megatron-LM's --bf16 sets --accumulate-allreduce-grads-in-fp32)
and for fp16 ones with that flag, else the param dtype.  Each tensor is the buffer's world view
without the padding at the end of each bucket -- and nothing else removed (the alignment gaps between
params hold zeros), so a param's position depends on megatron-core's buffer layout (`_ParamAndGradBuffer`):

* the buffer's params are `named_parameters()` (requires_grad) of the chunk in REVERSE order;
* every param starts at a multiple of 64 within its bucket (buckets start 128-aligned);
* a bucket closes after the param whose end reaches `bucket_size` elements from the bucket start,
  and a word embedding tied across pipeline stages (`shared_embedding`) gets a bucket of its own
  (the bucket before it then ends at its 64-aligned start);
* in the file, bucket k+1 follows bucket k's unpadded length directly.

`bucket_size` is Megatron-LM's (`get_model` + `DistributedDataParallel`): None without
--overlap-grad-reduce, for model chunks after the first, and on pipeline stages after the first;
else --ddp-bucket-size, or (all params of the rank) // --ddp-num-buckets, or
max(4e7, 1e6 * dp * cp).  All of these come from the `args` of model_optim_rng.pt (ours records the
flags it ran with, so the file and its args agree).  The layout is computed once, `MegatronBuffer`s from
our own params (same names, shapes, dtypes and megatron-core's module order,
megatron_optimizer_layout.megatron_module_order); reading checks every buffer's key and length against
the file (a mismatch is one CheckpointError naming the file), writing fills zeros laid out by it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..parallel import pipeline
from .megatron_optimizer_layout import inner_state, megatron_module_order
from .optimizer_state import STATE_KEYS

PARAM_ALIGN = 64  # _pad_start_of_param_if_needed


@dataclass
class MegatronBuffer:
    """One megatron-core grad buffer: its key in distrib_optim.pt, its params, and where each param's
    elements start in the file's coalesced tensors (`offsets`, by id) of `numel_unpadded` elements."""
    chunk: int
    key: tuple[torch.dtype, torch.dtype]  # (param dtype, grad dtype)
    params: list[torch.Tensor]
    offsets: dict[int, int]
    numel_unpadded: int


def is_megatron_distrib_optim(ps) -> bool:
    """megatron-core's dp_zero layout (or a ChainedOptimizer's list of them), not our previous flat one."""
    if isinstance(ps, list):
        return True
    return isinstance(ps, dict) and "numels" not in ps and ("buckets_coalesced" in ps or 0 in ps)


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP-style wrappers (each keeps the wrapped module as `.module`)."""
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


def grad_dtype_of(args, param_dtype: torch.dtype) -> torch.dtype:
    """The grad buffer's dtype Megatron-LM gives params of `param_dtype` (see the module docstring)."""
    if param_dtype == torch.float32 or getattr(args, "bf16", False) \
            or getattr(args, "accumulate_allreduce_grads_in_fp32", False):
        return torch.float32
    return param_dtype


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


def megatron_layout(named_chunks: list[list[tuple[str, torch.Tensor]]], args, pp_rank: int,
                    alone: set[int]) -> list[MegatronBuffer]:
    """The grad buffers of a rank whose model chunk c has the trainable params `named_chunks[c]`
    ((name, tensor) in our named_parameters order; any tensor of the param's shape and dtype stands for
    it), saved with `args` on pipeline stage `pp_rank`; `alone`: ids of shared-embedding params."""
    rank_numel = sum(p.numel() for named in named_chunks for _, p in named)
    out = []
    for c, named in enumerate(named_chunks):
        ordered = [named[i][1] for i in megatron_module_order([n for n, _ in named])]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in ordered:
            by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, params in by_dtype.items():
            offsets, total = buffer_layout(params, bucket_size_of(args, c, pp_rank, rank_numel), alone)
            out.append(MegatronBuffer(c, (dtype, grad_dtype_of(args, dtype)), params, offsets, total))
    return out


def training_layout(chunks, args, pp_rank: int) -> list[MegatronBuffer]:
    """megatron_layout of this training rank's model chunks."""
    chunks = [unwrap_model(c) for c in chunks]
    named = [[(n, p) for n, p in chunk.named_parameters() if p.requires_grad] for chunk in chunks]
    return megatron_layout(named, args, pp_rank, {id(p) for p in pipeline.tied_embedding_params(chunks)})


# ------------------------------------------------------------------ write

def grad_buffer_args(overlap_grad_reduce: bool, overlap_param_gather: bool, ddp_bucket_size: int | None) -> dict:
    """The Megatron-LM flags a distributed optimizer's checkpoint records in `args`: the layout of its
    distrib_optim.pt follows them (bucket_size_of); grads reduced in fp32, as with
    --accumulate-allreduce-grads-in-fp32."""
    return {"use_distributed_optimizer": True, "overlap_grad_reduce": bool(overlap_grad_reduce),
            "overlap_param_gather": bool(overlap_param_gather), "ddp_bucket_size": ddp_bucket_size,
            "accumulate_allreduce_grads_in_fp32": True}


def distributed_optimizer_entry(param_groups: list[dict], step: int | float, grad_scaler: dict | None) -> dict:
    """megatron-core's DistributedOptimizer.state_dict() (model_optim_rng.pt's optimizer entry): the
    param groups without "params", each with the step; the loss scaler's state where there is one."""
    out = {"optimizer": {"param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "step": step}
                                          for g in param_groups]}}
    if grad_scaler is not None:
        out["grad_scaler"] = grad_scaler
    return out


def empty_megatron_state(layout: list[MegatronBuffer]) -> tuple[dict, dict[int, tuple[dict, int]]]:
    """(distrib_optim.pt's content with zeros, {id(param): (its buffer's tensors, its offset)}): fill a
    param's `numel` elements of key X at tensors[X][offset:] to write it."""
    ps, place = {"buckets_coalesced": True}, {}
    for b, buffer in enumerate(layout):
        tensors = {key: torch.zeros(buffer.numel_unpadded, dtype=torch.float32) for key in STATE_KEYS}
        ps[b] = {buffer.key: {**tensors, "numel_unpadded": buffer.numel_unpadded}}
        for p in buffer.params:
            place[id(p)] = (ps[b][buffer.key], buffer.offsets[id(p)])
    return ps, place


# ------------------------------------------------------------------ read

def _placement(ps, layout: list[MegatronBuffer], path: Path) -> dict[int, tuple[dict, int]]:
    """{id(param): (its buffer's tensors in `ps`, its offset)}, every buffer checked against `layout`."""
    if isinstance(ps, list):
        raise CheckpointError(f"{path}: holds {len(ps)} distributed optimizers' states (megatron-core's "
                              f"ChainedOptimizer: expert-parallel or per-group optimizers); one is supported")
    if not ps.get("buckets_coalesced"):
        raise CheckpointError(f"{path}: megatron-core's legacy per-bucket distrib_optim.pt layout (no "
                              f"'buckets_coalesced'); re-save it with megatron-core >= 0.8")
    saved = sorted(k for k in ps if k != "buckets_coalesced")
    if saved != list(range(len(layout))):
        raise CheckpointError(f"{path}: grad buffers {saved} saved, this model has {len(layout)} "
                              f"(one per model chunk and param dtype)")
    place = {}
    for b, buffer in enumerate(layout):
        entry, dtype, total = ps[b], buffer.key[0], buffer.numel_unpadded
        if not isinstance(entry, dict) or len(entry) != 1:
            raise CheckpointError(f"{path}: grad buffer {b} should hold one (param dtype, grad dtype) entry")
        (key, tensors), = entry.items()
        if not isinstance(key, tuple) or key[0] != dtype:
            raise CheckpointError(f"{path}: grad buffer {b} saved for {key}, this model's params are {dtype}")
        for name in STATE_KEYS:
            t = tensors.get(name) if isinstance(tensors, dict) else None
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != total:
                raise CheckpointError(f"{path}: grad buffer {b} {name} should be a 1-D tensor of {total} elements "
                                      f"(megatron-core's layout of this model's {len(buffer.params)} {dtype} params), "
                                      f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if tensors.get("numel_unpadded", total) != total:
            raise CheckpointError(f"{path}: grad buffer {b} numel_unpadded {tensors['numel_unpadded']}, this model's "
                                  f"layout has {total}")
        place.update((id(p), (tensors, buffer.offsets[id(p)])) for p in buffer.params)
    return place


def saved_group_step(optimizer_entry: dict, path: Path) -> int:
    """The step DistributedOptimizer.state_dict() keeps in each param group (its file has none)."""
    steps = {int(g["step"]) for g in inner_state(optimizer_entry)["param_groups"] if g.get("step") is not None}
    if len(steps) > 1:
        raise CheckpointError(f"{path}: the optimizer entry's param groups disagree on the step: {sorted(steps)}")
    return steps.pop() if steps else 0


def parameter_state_from_megatron(ps, optimizer_entry: dict, layout: list[MegatronBuffer],
                                  model_params: list[torch.Tensor], path: Path) -> dict:
    """megatron-core's distrib_optim.pt (`ps`, from `path`) + the optimizer entry of model_optim_rng.pt
    (its groups carry the step) -> our parameter state for `model_params` (the tensors `layout` holds)."""
    place = _placement(ps, layout, path)
    flat = {key: [] for key in STATE_KEYS}
    for i, p in enumerate(model_params):
        if id(p) not in place:
            raise CheckpointError(f"{path}: optimizer param {i} ({tuple(p.shape)}) is in no grad buffer of the model")
        tensors, at = place[id(p)]
        for key in flat:
            flat[key].append(tensors[key][at:at + p.numel()].float().cpu())
    return {"numels": [p.numel() for p in model_params], "step": saved_group_step(optimizer_entry, path),
            **{k: torch.cat(v) if v else torch.zeros(0) for k, v in flat.items()}}
