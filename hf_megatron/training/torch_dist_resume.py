"""Resume training from a checkpoint Megatron-LM's `save_checkpoint` wrote with --ckpt-format torch_dist
(megatron-core 0.16.1 `dist_checkpointing.save`), in any TP/PP layout of this run.

What such an iteration folder holds (`generate_state_dict` with use_dist_ckpt, no distributed optimizer):

    .metadata, __*_*.distcp   torch.distributed.checkpoint; every tensor once at its global shape
        <model key>                           the model's sharded_state_dict: per-layer params stacked
                                              [L, ...] (`decoder.layers.mlp.linear_fc1.weight`), TP
                                              shards merged, vocab tables padded
        optimizer.state.exp_avg.<model key>   Adam's moments, the model key's shape, fp32
        optimizer.state.exp_avg_sq.<model key>
        optimizer.state.fp32_param.<model key>  the fp32 main weight (Float16OptimizerWithFloat16Params
                                              only: bf16 / fp16 model params)
    common.pt   args, checkpoint_version, iteration, opt_param_scheduler, num_floating_point_operations_so_far,
                optimizer: what is left of its state dict once the tensors are taken out --
                    FP32Optimizer:   {"state": {"common_step": step}, "param_groups": [...]}
                    Float16Opt...:   {"optimizer": {"state": {"common_step"}, "param_groups"}, "grad_scaler"?}
                param groups without their `params` lists (megatron-core saves those as non-persistent)
    rng_state    a byte entry `rng_state/shard_<pp>.<tp>_<PP>.<TP>` per (pp, tp) rank: its RNG list

megatron-core's ChainedOptimizer of one optimizer (a dense model) saves its one optimizer's entry as is.
With the distributed optimizer (common.pt's optimizer entry names its `param_state_sharding_type`) either
of the two shardings Megatron-LM writes is read (`_distributed_optimizer_state`), into our parameter
state (optimizer_state.py), which load_checkpoint hands to the optimizer with the param groups:

    fully_reshardable   optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>: each weight's shape,
                        fp32; param groups (each with the step) and grad_scaler in common.pt -- any
                        TP/PP layout, as the model's tensors
    dp_reshardable      (Megatron-LM's default) per grad buffer g and bucket b
                        optimizer.distributed.dp_group_idx_<r>.gbuf_idx_<g>.dtype_<(param dtype, grad
                        dtype)>.bucket_idx_<b>.{param,exp_avg,exp_avg_sq}: the bucket's unpadded
                        elements; `...dp_group_idx_<r>.optimizer` / `.grad_scaler` ShardedObjects hold
                        the param groups and scaler.  r is the rank in megatron-core's model-parallel
                        group (pp_rank * tp + tp_rank; tested at tp 2); the buckets concatenated are
                        distrib_optim.pt's coalesced tensors, read by megatron_distrib_optim.py's
                        layout -- so only at the saved TP/PP (any dp), as megatron-core itself.

Other shardings (fully_sharded_model_space, dp_zero_gather_scatter, fsdp_dtensor) are refused in one line:
resume them with --no-load-optim.

`read_torch_dist` turns that into what a torch-format rank file of this rank would hold: every model
chunk's tensors (cut for this rank's TP shard and pipeline stage) and the optimizer entry in
Megatron-LM's torch layout (megatron_optimizer_layout.py), its state indices numbered in megatron-core's
param order -- the order `megatron_groups` gives -- with each param's moments read under its own
sharded key and the common step.  `training.checkpoint.load_checkpoint` then restores it exactly as a
rank file.  Reading goes through checkpoint/torch_dist.py: `.metadata` through its allow-listed
unpickler, common.pt through safe_load, tensor data with weights_only loads; nothing runs code.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from ..checkpoint.names import to_stage_local
from ..checkpoint.torch_dist import TorchDistCheckpoint
from ..checkpoint.unpickle import safe_load
from ..errors import CheckpointError
from ..parallel import comm, state as parallel_state
from ..parallel.sharding import split_tensor
from .megatron_distrib_optim import parameter_state_from_megatron, saved_group_step, training_layout
from .optimizer_state import MOMENTS, STATE_KEYS
from .tied_embedding import source_name

OPTIMIZER_PREFIX = "optimizer.state."
DISTRIBUTED_PREFIX = "optimizer.distributed.dp_group_idx_"
_BUCKET_KEY = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)"
                         r"\.(param|exp_avg|exp_avg_sq)")
PARAMETER_STATE = "optimizer_parameter_state"  # payload key: our parameter state (optimizer_state.py), read here
_RNG_KEY = re.compile(r"rng_state/shard_([\d.]+)_([\d.]+)")


def is_torch_dist_folder(folder: Path) -> bool:
    """The marker files megatron-core's dist_checkpointing writes (load.open_megatron's rule)."""
    return (folder / ".metadata").is_file() or (folder / "metadata.json").is_file()


def _rank_shard(ckpt: TorchDistCheckpoint, chunk, name: str, prefix: str = "") -> torch.Tensor:
    """This rank's TP shard of the full tensor `prefix + <sharded key of name>`."""
    group = getattr(chunk, "tp_group", None)
    full = ckpt.get(source_name([chunk], name), prefix=prefix)
    return split_tensor(name, full, chunk.config, comm.group_size(group))[comm.group_rank(group)]


def _model_entries(ckpt: TorchDistCheckpoint, chunks) -> dict[str, dict[str, torch.Tensor]]:
    """model / model0, model1, ...: each chunk's tensors as its rank file holds them (stage-local layers);
    names the checkpoint lacks are left out (load_checkpoint's strict check names them)."""
    keys = ["model"] if len(chunks) == 1 else [f"model{v}" for v in range(len(chunks))]
    out = {}
    for key, chunk in zip(keys, chunks):
        state = {}
        for name in chunk.state_dict():
            if source_name([chunk], name) in ckpt.where:
                state[name] = _rank_shard(ckpt, chunk, name)
        out[key] = to_stage_local(state, chunk.layer_numbers)
    return out


def _optimizer_entry(ckpt: TorchDistCheckpoint, saved: Any, chunks, optimizer, where: Path) -> dict:
    """Megatron-LM's torch-layout optimizer entry for this rank's params, from the torch_dist one."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where}: holds no optimizer state (saved with --no-save-optim?); load it "
                              "without an optimizer (--no-load-optim or --finetune)")
    float16 = "param_groups" not in saved
    inner = saved.get("optimizer") if float16 else saved
    if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list) \
            or not all(isinstance(g, dict) for g in inner["param_groups"]) or not isinstance(inner.get("state"), dict):
        raise CheckpointError(f"{where}: optimizer entry is neither FP32Optimizer's ('state', 'param_groups') nor "
                              "Float16OptimizerWithFloat16Params' ('optimizer' -> 'state', 'param_groups')")
    step = inner["state"].get("common_step")
    if step is not None and not (isinstance(step, (int, float)) or isinstance(step, torch.Tensor) and step.numel() == 1):
        raise CheckpointError(f"{where}: optimizer state's common_step should be a number, found {type(step).__name__}")
    groups, _ = optimizer.megatron_order
    if len(inner["param_groups"]) != len(groups):
        raise CheckpointError(f"{where}: {len(inner['param_groups'])} optimizer param groups saved, this "
                              f"optimizer has {len(groups)}")
    owner = {id(p): (chunk, name) for chunk in chunks for name, p in chunk.named_parameters()}
    state, param_groups, halves, k = {}, [], [], 0
    for group, indices in zip(inner["param_groups"], groups):
        params, low = [], []
        for i in indices:
            p = optimizer.model_params[i]
            chunk, name = owner[id(p)]
            if step is not None:
                state[k] = {"step": torch.as_tensor(step, dtype=torch.float32).clone(),
                            **{m: _rank_shard(ckpt, chunk, name, f"{OPTIMIZER_PREFIX}{m}.") for m in MOMENTS}}
            if float16 and p.dtype != torch.float32:
                low.append(_rank_shard(ckpt, chunk, name, f"{OPTIMIZER_PREFIX}fp32_param."))
            params.append(k)
            k += 1
        param_groups.append({**group, "params": params})
        halves.append(low)
    entry = {"state": state, "param_groups": param_groups}
    if not float16:
        return entry
    out = {"optimizer": entry, "fp32_from_fp16_params": halves}
    if "grad_scaler" in saved:
        out["grad_scaler"] = saved["grad_scaler"]
    return out


def _distributed_optimizer_state(ckpt: TorchDistCheckpoint, saved: dict, chunks, optimizer, where: Path
                                 ) -> tuple[dict, dict]:
    """megatron-core's DistributedOptimizer entry -> (its hyper-parameter entry {"optimizer": {"param_groups"},
    "grad_scaler"?}, our parameter state for `optimizer`'s params); see the module docstring."""
    kind = saved["param_state_sharding_type"]
    if kind == "fully_reshardable":
        entry = {k: v for k, v in saved.items() if k in ("optimizer", "grad_scaler")}
        if not isinstance(entry.get("optimizer"), dict):
            raise CheckpointError(f"{where}: the distributed optimizer's entry has no 'optimizer' (its param groups)")
        owner = {id(p): (chunk, name) for chunk in chunks for name, p in chunk.named_parameters()}
        flat = {key: [_rank_shard(ckpt, *owner[id(p)], f"{OPTIMIZER_PREFIX}{key}.").reshape(-1).float()
                      for p in optimizer.model_params] for key in STATE_KEYS}
        ps = {"numels": [p.numel() for p in optimizer.model_params], "step": saved_group_step(entry, where),
              **{k: torch.cat(v) if v else torch.zeros(0) for k, v in flat.items()}}
        return entry, ps
    if kind != "dp_reshardable":
        raise CheckpointError(f"{where}: megatron-core's distributed optimizer state in its {kind!r} sharding is not "
                              "read (Megatron-LM's dp_reshardable and fully_reshardable are); resume with "
                              "--no-load-optim (weights, iteration, data position)")
    st = parallel_state.get_state()
    saved_grid = (getattr(ckpt.args, "tensor_model_parallel_size", 1), getattr(ckpt.args, "pipeline_model_parallel_size", 1))
    if saved_grid != (st.tp, st.pp):
        raise CheckpointError(f"{where}: megatron-core's dp_reshardable distributed optimizer state (grad-buffer "
                              f"space) loads at the saved tp, pp = {saved_grid} only, this run has ({st.tp}, {st.pp}); "
                              "resume it there or with --no-load-optim")
    group = st.coords["pp"] * st.tp + st.coords["tp"]  # the rank in megatron-core's model-parallel group
    prefix = f"{DISTRIBUTED_PREFIX}{group}."
    entry = {}
    for name in ("optimizer", "grad_scaler"):  # ShardedObjects of shape (1,)
        if f"{prefix}{name}/shard_0_1" in ckpt.metadata.state_dict_metadata:
            obj = ckpt.read_object(f"{prefix}{name}/shard_0_1")
            entry[name] = obj[0] if isinstance(obj, list) and len(obj) == 1 else obj
    if not isinstance(entry.get("optimizer"), dict):
        raise CheckpointError(f"{where}: no entry {prefix}optimizer (megatron-core's param groups of this rank's "
                              "distributed optimizer)")
    buckets: dict[int, dict[str, dict[int, dict[str, str]]]] = {}
    for key in ckpt.metadata.state_dict_metadata:
        match = _BUCKET_KEY.fullmatch(key)
        if match and int(match.group(1)) == group:
            gbuf, dtype, bucket, state_key = int(match.group(2)), match.group(3), int(match.group(4)), match.group(5)
            buckets.setdefault(gbuf, {}).setdefault(dtype, {}).setdefault(bucket, {})[state_key] = key
    layout = training_layout(chunks, ckpt.args, st.coords["pp"])
    ps = {"buckets_coalesced": True}  # the buckets concatenated: what distrib_optim.pt holds
    for gbuf, by_dtype in buckets.items():
        buffer = layout[gbuf] if gbuf < len(layout) else None
        if buffer is None or list(by_dtype) != [f"{buffer.key}"]:
            raise CheckpointError(f"{where}: grad buffer {gbuf} saved for {sorted(by_dtype)}, this model has "
                                  f"{[f'{b.key}' for b in layout]}")
        (parts,) = by_dtype.values()
        if sorted(parts) != list(range(len(parts))) or any(sorted(v) != sorted(STATE_KEYS) for v in parts.values()):
            raise CheckpointError(f"{where}: grad buffer {gbuf}'s buckets {sorted(parts)} should be 0.. each with "
                                  f"{', '.join(STATE_KEYS)}")
        tensors = {k: torch.cat([ckpt._read(parts[b][k], None).float() for b in range(len(parts))]) for k in STATE_KEYS}
        ps[gbuf] = {buffer.key: {**tensors, "numel_unpadded": tensors["param"].numel()}}
    return entry, parameter_state_from_megatron(ps, entry, layout, optimizer.model_params, where)


def _rng_entry(ckpt: TorchDistCheckpoint):
    """This rank's `rng_state`: Megatron-LM saves its list as ShardedObject 'rng_state' on the (pp, tp) grid
    (or (pp, tp, dp) with one list per dp rank), byte entry `rng_state/shard_<offset>_<shape>`.  The
    cell at this rank's coordinates when the saved grid is this run's; else [] (RNG streams are per
    rank: another layout starts them from --seed); None when it holds none (--no-save-rng)."""
    st = parallel_state.get_state()
    here, grid = (st.coords["pp"], st.coords["tp"], st.coords["dp"]), (st.pp, st.tp, st.dp)
    found = None
    for key, md in ckpt.metadata.state_dict_metadata.items():
        match = _RNG_KEY.fullmatch(key)
        if match is None or not isinstance(md, BytesStorageMetadata):
            continue
        found = []
        offset, shape = (tuple(int(x) for x in match.group(g).split(".")) for g in (1, 2))
        if len(offset) == len(shape) in (2, 3) and offset == here[:len(offset)] and shape == grid[:len(shape)]:
            saved = ckpt.read_object(key)  # megatron-core stores [data] for a ShardedObject
            if not isinstance(saved, list) or len(saved) != 1:
                raise CheckpointError(f"{ckpt.folder}: entry {key!r} should hold [the rng_state list] "
                                      f"(megatron-core's ShardedObject), found {type(saved).__name__}")
            return saved[0]
    return found


def read_torch_dist(folder: Path, iteration: int | str, chunks, optimizer=None) -> tuple[dict, int | str, Path]:
    """(this rank's payload in the torch-format rank file's layout, iteration, common.pt): model
    entries for `chunks` (built, any TP/PP), the optimizer entry for `optimizer` when given."""
    ckpt = TorchDistCheckpoint(folder, iteration)
    common_file = folder / "common.pt"
    if not common_file.is_file():
        raise CheckpointError(f"{common_file}: missing (Megatron-LM's save_checkpoint writes the common state there)")
    common = safe_load(common_file)
    payload = {k: v for k, v in common.items() if k != "optimizer"}
    payload.update(_model_entries(ckpt, chunks))
    payload["rng_state"] = _rng_entry(ckpt)
    saved = common.get("optimizer")
    if optimizer is not None and isinstance(saved, dict) and "param_state_sharding_type" in saved:
        payload["optimizer"], payload[PARAMETER_STATE] = _distributed_optimizer_state(ckpt, saved, chunks, optimizer,
                                                                                     common_file)
    elif optimizer is not None:
        payload["optimizer"] = _optimizer_entry(ckpt, saved, chunks, optimizer, common_file)
    return payload, iteration, common_file
