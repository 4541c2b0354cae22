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
The distributed optimizer's entry (`param_state_sharding_type`, Megatron-LM's default 'dp_reshardable':
flat buffers cut per dp rank) is refused in one line: resume it with --no-load-optim.

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

OPTIMIZER_PREFIX = "optimizer.state."
MOMENTS = ("exp_avg", "exp_avg_sq")
_RNG_KEY = re.compile(r"rng_state/shard_([\d.]+)_([\d.]+)")


def is_torch_dist_folder(folder: Path) -> bool:
    """The marker files megatron-core's dist_checkpointing writes (load.open_megatron's rule)."""
    return (folder / ".metadata").is_file() or (folder / "metadata.json").is_file()


def _source_name(chunk, name: str) -> str:
    """The checkpoint tensor a param of ours is: the last stage's copy of a tied table is the embedding."""
    tied_copy = chunk.output_layer is not None and chunk.embedding is None and chunk.config.tie_word_embeddings
    return "embedding.word_embeddings.weight" if tied_copy and name == "output_layer.weight" else name


def _rank_shard(ckpt: TorchDistCheckpoint, chunk, name: str, prefix: str = "") -> torch.Tensor:
    """This rank's TP shard of the full tensor `prefix + <sharded key of name>`."""
    group = getattr(chunk, "tp_group", None)
    full = ckpt.get(_source_name(chunk, name), prefix=prefix)
    return split_tensor(name, full, chunk.config, comm.group_size(group))[comm.group_rank(group)]


def _model_entries(ckpt: TorchDistCheckpoint, chunks) -> dict[str, dict[str, torch.Tensor]]:
    """model / model0, model1, ...: each chunk's tensors as its rank file holds them (stage-local layers);
    names the checkpoint lacks are left out (load_checkpoint's strict check names them)."""
    keys = ["model"] if len(chunks) == 1 else [f"model{v}" for v in range(len(chunks))]
    out = {}
    for key, chunk in zip(keys, chunks):
        state = {}
        for name in chunk.state_dict():
            if _source_name(chunk, name) in ckpt.where:
                state[name] = _rank_shard(ckpt, chunk, name)
        out[key] = to_stage_local(state, chunk.layer_numbers)
    return out


def _optimizer_entry(ckpt: TorchDistCheckpoint, saved: Any, chunks, optimizer, where: Path) -> dict:
    """Megatron-LM's torch-layout optimizer entry for this rank's params, from the torch_dist one."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where}: holds no optimizer state (saved with --no-save-optim?); load it "
                              "without an optimizer (--no-load-optim or --finetune)")
    if "param_state_sharding_type" in saved:  # DistributedOptimizer: flat per-dp-rank buffers, not read yet
        raise CheckpointError(f"{where}: optimizer state of megatron-core's distributed optimizer (param_state_"
                              f"sharding_type {saved['param_state_sharding_type']!r}) is not read; resume with "
                              "--no-load-optim (weights, iteration, data position) or save with --ckpt-format torch")
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


def _rng_entry(ckpt: TorchDistCheckpoint):
    """This rank's `rng_state`: Megatron-LM saves its list as ShardedObject 'rng_state' on the (pp, tp) grid
    (or (pp, tp, dp) with one list per dp rank), byte entry `rng_state/shard_<offset>_<shape>`.  The
    cell at this rank's coordinates when the saved grid is this run's; else None (RNG streams are per
    rank: another layout starts them from --seed)."""
    st = parallel_state.get_state()
    here, grid = (st.coords["pp"], st.coords["tp"], st.coords["dp"]), (st.pp, st.tp, st.dp)
    for key, md in ckpt.metadata.state_dict_metadata.items():
        match = _RNG_KEY.fullmatch(key)
        if match is None or not isinstance(md, BytesStorageMetadata):
            continue
        offset, shape = (tuple(int(x) for x in match.group(g).split(".")) for g in (1, 2))
        if len(offset) == len(shape) in (2, 3) and offset == here[:len(offset)] and shape == grid[:len(shape)]:
            saved = ckpt.read_object(key)  # megatron-core stores [data] for a ShardedObject
            if not isinstance(saved, list) or len(saved) != 1:
                raise CheckpointError(f"{ckpt.folder}: entry {key!r} should hold [the rng_state list] "
                                      f"(megatron-core's ShardedObject), found {type(saved).__name__}")
            return saved[0]
    return None


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
    if optimizer is not None:
        payload["optimizer"] = _optimizer_entry(ckpt, common.get("optimizer"), chunks, optimizer, common_file)
    return payload, iteration, common_file
