"""Write a training checkpoint as Megatron-LM's `--ckpt-format torch_dist` (megatron-core 0.16.1's
`dist_checkpointing.save` of what its `save_checkpoint` composes), for a run without the distributed
optimizer, one model chunk, any tp, pp and dp.  Every rank of dp rank 0 (cp rank 0) sends its model
shards, fp32 main weights, Adam moments and RNG list to global rank 0 (`gather_object`), which merges the
TP shards with the plan that split them (`parallel.sharding.merge_tensor`: concatenation on the split dim,
SwiGLU fc1 [gate_r; up_r] -> [gate; up], vocab padding cut, then padded again for the run's tp), stacks
the pipeline stages' layers and writes the folder alone.  Memory: the whole model (weights, and with the
optimizer its fp32 main weights and two moments) once, on global rank 0's CPU.  The distributed optimizer
is refused in one line (`unsupported`).

What megatron-core writes for such a run (seen by saving one with it; torch_dist_resume.py reads it):

    .metadata, __0_0.distcp   torch.distributed.checkpoint, every tensor once at its global shape
        <model key>                             model.sharded_state_dict(): per-layer params stacked
                                                [L, ...], TP shards merged, vocab tables padded for tp,
                                                `_extra_state` [None] objects (one per layer, any tp)
        optimizer.state.exp_avg.<model key>     Adam's moments (optim_state_to_sharding_state), fp32
        optimizer.state.exp_avg_sq.<model key>
        optimizer.state.fp32_param.<model key>  the fp32 main weight of a bf16 / fp16 param
                                                (Float16OptimizerWithFloat16Params only)
        rng_state/shard_<pp>.<tp>_<PP>.<TP>     ShardedObject on the (pp, tp) grid, one byte entry per cell:
                                                [that rank's rng_state list] (dp rank 0's: replica 0)
    common.pt   args, checkpoint_version, iteration, opt_param_scheduler, num_floating_point_operations_so_far,
                content_metadata (Megatron-LM's sharded_sd_metadata), and the optimizer without its tensors:
                    FP32Optimizer:   {"state": {"common_step": step}, "param_groups": [groups without params]}
                    Float16Opt...:   {"optimizer": {"state": {"common_step"}, "param_groups"}, "grad_scaler"?}
                plus our entries of a torch-format rank file (consumed_train_samples, loss, ...).
    metadata.json   the backends

The state index k of the optimizer's entry (megatron_optimizer_layout.to_megatron: megatron-core's group
order) names param `model_params[megatron_order[k]]`, whose sharded key the tensors take.  The last
stage's copy of tied word embeddings is stored once, as the embedding (megatron-core's replica of it).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.torch_dist import global_entries, save_common, save_entries
from ..checkpoint.writer import CHECKPOINT_VERSION
from ..parallel import state as parallel_state
from ..parallel.sharding import merge_tensor
from .optimizer_state import MOMENTS
from .tied_embedding import source_name
from .torch_dist_resume import OPTIMIZER_PREFIX
# Megatron-LM's _build_sharded_state_dict_metadata without the distributed optimizer
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def unsupported(distributed_optimizer: bool) -> str | None:
    """Why a run cannot save torch_dist (one line naming the flag), or None."""
    if not distributed_optimizer:
        return None
    return ("--ckpt-format torch_dist with --use-distributed-optimizer: train writes torch_dist only without "
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


def _local_parts(chunk, optimizer, optim_state: dict | None) -> tuple[dict[str, dict], dict | None]:
    """({"model" / state key: {stored name: this rank's shard, on CPU}}, the optimizer's common.pt entry);
    the last stage's tied copy of the embedding is left out (the first stage's is stored)."""
    parts = {"model": list(chunk.state_dict().items())}
    common = None
    if optim_state is not None:
        tensors, common = _optimizer_entries(chunk, optimizer, optim_state)
        parts.update({f"{OPTIMIZER_PREFIX}{key}.": named for key, named in tensors.items()})
    return {kind: {name: t.detach().to("cpu") for name, t in named if source_name([chunk], name) == name}
            for kind, named in parts.items()}, common


def _gathered(mine) -> list | None:
    """Every rank's `mine` on global rank 0 (a list in rank order), None elsewhere; one process: [mine]."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return parts


def write_torch_dist_iteration(iter_dir: Path, chunk, optimizer, megatron_args, iteration: int,
                               extra: dict[str, Any], rng_state: list | None, optim_state: dict | None,
                               scheduler_state: dict | None) -> None:
    """The whole iteration folder (see the module docstring) into `iter_dir` (the staging folder).  A
    collective: every rank calls it, global rank 0 writes.  `optim_state` is `optimizer.state_dict()` (None:
    no optimizer state saved), `extra` our entries of a rank file, `rng_state` this rank's Megatron-LM list
    (None: not saved); `megatron_args` / `extra` / `scheduler_state` are global rank 0's."""
    st = parallel_state.get_state()
    replica = st.coords["dp"] != 0 or st.coords["cp"] != 0  # dp / cp replicas hold the same state
    mine = None if replica else (st.coords["tp"], st.coords["pp"], *_local_parts(chunk, optimizer, optim_state),
                                 rng_state)
    received = _gathered(mine)
    if received is None:
        return
    config = chunk.config
    shards: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    state: dict[str, Any] = {}
    for tp_rank, pp_rank, parts, _, rng in filter(None, received):
        for kind, named in parts.items():
            for name, tensor in named.items():
                shards.setdefault(kind, {}).setdefault(name, {})[tp_rank] = tensor
        if rng is not None:  # ShardedObject "rng_state" of shape (pp, tp) at that rank's cell: [its data]
            state[f"rng_state/shard_{pp_rank}.{tp_rank}_{st.pp}.{st.tp}"] = [rng]
    for kind, by_name in shards.items():
        full = ((name, merge_tensor(name, [by_rank[r] for r in sorted(by_rank)], config))
                for name, by_rank in by_name.items())
        state.update(global_entries(config, full, st.tp, prefix="" if kind == "model" else kind,
                                    extra_state=kind == "model", where=iter_dir))
    common: dict[str, Any] = {"args": megatron_args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                              "num_floating_point_operations_so_far": 0,
                              "content_metadata": dict(CONTENT_METADATA)}
    if optim_state is not None:
        common["optimizer"] = mine[3]
    if scheduler_state is not None:
        common["opt_param_scheduler"] = scheduler_state
    save_entries(iter_dir, state)
    save_common(iter_dir, {**common, **extra})
