"""Write a training checkpoint as Megatron-LM's `--ckpt-format torch_dist` (megatron-core 0.16.1's
`dist_checkpointing.save` of what its `save_checkpoint` composes), for a run without the distributed
optimizer at tp 1, pp 1, one model chunk (any dp: the state is replicated, global rank 0 writes
it); other layouts are refused in one line (`unsupported`).

What megatron-core writes for such a run (seen by saving one with it; torch_dist_resume.py reads it):

    .metadata, __0_0.distcp   torch.distributed.checkpoint, every tensor once at its global shape
        <model key>                             model.sharded_state_dict(): per-layer params stacked
                                                [L, ...], vocab tables padded, `_extra_state` [None] objects
        optimizer.state.exp_avg.<model key>     Adam's moments (optim_state_to_sharding_state), fp32
        optimizer.state.exp_avg_sq.<model key>
        optimizer.state.fp32_param.<model key>  the fp32 main weight of a bf16 / fp16 param
                                                (Float16OptimizerWithFloat16Params only)
        rng_state/shard_0.0_1.1                 ShardedObject on the (pp, tp) grid: [the rng_state list]
    common.pt   args, checkpoint_version, iteration, opt_param_scheduler, num_floating_point_operations_so_far,
                content_metadata (Megatron-LM's sharded_sd_metadata), and the optimizer without its tensors:
                    FP32Optimizer:   {"state": {"common_step": step}, "param_groups": [groups without params]}
                    Float16Opt...:   {"optimizer": {"state": {"common_step"}, "param_groups"}, "grad_scaler"?}
                plus our entries of a torch-format rank file (consumed_train_samples, loss, ...).
    metadata.json   the backends

The state index k of the optimizer's entry (megatron_optimizer_layout.to_megatron: megatron-core's group
order) names param `model_params[megatron_order[k]]`, whose sharded key the tensors take.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..checkpoint.torch_dist import global_entries, save_common, save_entries
from ..checkpoint.writer import CHECKPOINT_VERSION
from ..parallel import state as parallel_state
from .optimizer_state import MOMENTS
from .torch_dist_resume import OPTIMIZER_PREFIX
# Megatron-LM's _build_sharded_state_dict_metadata without the distributed optimizer
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def unsupported(tp: int, pp: int, distributed_optimizer: bool) -> str | None:
    """Why a run in this layout cannot save torch_dist (one line naming the flags), or None."""
    flags = [f"--{flag} {value}" for flag, value in (
        ("tensor-model-parallel-size", tp), ("pipeline-model-parallel-size", pp)) if value != 1]
    if distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    if not flags:
        return None
    return (f"--ckpt-format torch_dist with {' '.join(flags)}: train writes torch_dist only at tp 1, pp 1 without "
            "--use-distributed-optimizer; save with --ckpt-format torch, then `hf-megatron reshard --ckpt-format "
            "torch_dist` (train --load resumes either)")


def _optimizer_entries(chunk, optimizer, sd: dict) -> tuple[dict[str, list], dict]:
    """({state key: [(param name, full tensor)]}, the optimizer's common.pt entry) from its
    torch-layout entry `sd` (Megatron-LM's FP32Optimizer / Float16OptimizerWithFloat16Params layout)."""
    float16 = "param_groups" not in sd
    inner = sd["optimizer"] if float16 else sd
    groups, _ = optimizer.megatron_order
    name_of = {id(p): n for n, p in chunk.named_parameters()}
    tensors: dict[str, list] = {key: [] for key in (*MOMENTS, "fp32_param")}
    step, k = None, 0
    for g, indices in enumerate(groups):
        halves = iter(sd["fp32_from_fp16_params"][g] if float16 else [])
        for i in indices:
            p = optimizer.model_params[i]
            name = name_of[id(p)]
            entry = inner["state"].get(k)
            if entry is not None:
                step = entry.get("step", step)
                for key in MOMENTS:
                    tensors[key].append((name, entry[key]))
            if float16 and p.dtype != torch.float32:
                tensors["fp32_param"].append((name, next(halves)))
            k += 1
    common_inner = {"state": {"common_step": step} if step else {},
                    "param_groups": [{k: v for k, v in group.items() if k != "params"}
                                     for group in inner["param_groups"]]}
    if not float16:
        return tensors, common_inner
    common = {"optimizer": common_inner}
    if "grad_scaler" in sd:
        common["grad_scaler"] = sd["grad_scaler"]
    return tensors, common


def write_torch_dist_iteration(iter_dir: Path, chunk, optimizer, megatron_args, iteration: int,
                               extra: dict[str, Any], rng_state: list | None, optim_state: dict | None,
                               scheduler_state: dict | None) -> None:
    """The whole iteration folder (see the module docstring) into `iter_dir` (the staging folder), from
    this process: `optim_state` is `optimizer.state_dict()` (None: no optimizer state saved), `extra`
    our entries of a rank file, `rng_state` Megatron-LM's list (None: not saved)."""
    st = parallel_state.get_state()
    config = chunk.config
    state = global_entries(config, chunk.state_dict().items(), extra_state=True, where=iter_dir)
    common: dict[str, Any] = {"args": megatron_args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                              "num_floating_point_operations_so_far": 0,
                              "content_metadata": dict(CONTENT_METADATA)}
    if optim_state is not None:
        tensors, common["optimizer"] = _optimizer_entries(chunk, optimizer, optim_state)
        for key, named in tensors.items():
            state.update(global_entries(config, named, prefix=f"{OPTIMIZER_PREFIX}{key}.", where=iter_dir))
    if scheduler_state is not None:
        common["opt_param_scheduler"] = scheduler_state
    if rng_state is not None:  # ShardedObject "rng_state" of shape (pp, tp) at this rank's cell: [its data]
        state[f"rng_state/shard_{st.coords['pp']}.{st.coords['tp']}_{st.pp}.{st.tp}"] = [rng_state]
    save_entries(iter_dir, state)
    save_common(iter_dir, {**common, **extra})
