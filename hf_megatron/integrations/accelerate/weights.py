"""The prepared model's full weights under Hugging Face names, gathered over TP and PP.

Every rank of data-parallel rank 0 holds a shard: its pipeline stage's layers (global layer
numbers in memory), tensor-parallel slices by the architecture's plan.  `gather_full` collects
them on one rank (or all) and merges each tensor with the same plan that split it
(`parallel.sharding.merge_tensor`: TP concatenation, per-part for fused tensors, vocab padding
removed); the mapping table (`architectures.mcore_to_hf`) then gives transformers' names.  The
last stage's copy of tied word embeddings is dropped (it equals the first stage's).
Under bf16 / fp16 the weights are the optimizer's fp32 main weights (`fp32_main_weights`), what
plain accelerate's mixed precision trains and saves (fp32 params under autocast).

These are collectives: every rank calls them.  Memory: the full model on the receiving rank(s),
on CPU.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from ...architectures import mcore_to_hf
from ...conversion.hf_writer import write_hf_config, write_hf_weights
from ...parallel import state
from ...parallel.sharding import merge_tensor

WEIGHT_FILE_PREFIXES = ("model.safetensors", "model-0", "pytorch_model")


@torch.no_grad()
def fp32_main_weights(optimizer) -> dict[int, torch.Tensor]:
    """id(param) -> its fp32 main weight (the optimizer's), for every bf16 / fp16 param: what plain
    accelerate's mixed precision (autocast over fp32 params) trains and saves.  A distributed
    optimizer holds each param's elements on one dp rank: summed over the dp group (every dp rank
    calls this), the others contributing zeros."""
    if optimizer is None:
        return {}
    low = [p for p in optimizer.model_params if p.dtype != torch.float32]
    full = {id(p): torch.zeros(p.numel(), dtype=torch.float32, device=p.device) for p in low}
    for (p, lo, hi), main, view in zip(optimizer.fragments, optimizer.main_params, optimizer._model_views):
        if view is not None:
            full[id(p)][lo:hi] = main.view(-1)
    group = optimizer.dp_group
    if optimizer.sharded and low and group is not None and dist.get_world_size(group) > 1:
        flat = torch.cat([full[id(p)] for p in low])
        dist.all_reduce(flat, group=group)
        full = dict(zip([id(p) for p in low], flat.split([p.numel() for p in low])))
    return {id(p): full[id(p)].view_as(p) for p in low}


def _local_shard(chunks, optimizer=None) -> dict[str, torch.Tensor]:
    mains = fp32_main_weights(optimizer)
    grid = state.get_state()
    if grid.coords["dp"] != 0 or grid.coords["cp"] != 0:
        return {}  # data-parallel replicas hold the same values
    config = chunks[0].config
    local = {}
    for chunk in chunks:
        for name, tensor in chunk.state_dict(keep_vars=True).items():
            if name == "output_layer.weight" and config.tie_word_embeddings:
                continue  # the last stage's copy of the tied table
            local[name] = mains.get(id(tensor), tensor).detach().to("cpu", copy=True)
    return local


def gather_full(chunks, dst: int | None, optimizer=None) -> dict[str, torch.Tensor] | None:
    """Full megatron-core tensors on global rank `dst` (None: on every rank); None elsewhere.
    With the engine's `optimizer`, bf16 / fp16 params are its fp32 main weights (fp32_main_weights)."""
    config = chunks[0].config
    grid = state.get_state()
    mine = (grid.coords["tp"], _local_shard(chunks, optimizer))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list | None = [None] * dist.get_world_size()
        if dst is None:
            dist.all_gather_object(parts, mine)
        else:
            dist.gather_object(mine, parts if dist.get_rank() == dst else None, dst=dst)
            if dist.get_rank() != dst:
                return None
    else:
        parts = [mine]
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for tp_rank, local in parts:
        for name, tensor in local.items():
            shards.setdefault(name, {})[tp_rank] = tensor
    return {name: merge_tensor(name, [by_rank[r] for r in sorted(by_rank)], config)
            for name, by_rank in shards.items()}


def hf_state_dict(full: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Full megatron-core tensors -> transformers names (`lm_head.weight` too when tied, as the
    transformers model's own state_dict has it)."""
    out = dict(mcore_to_hf(full.__getitem__, config))
    if config.tie_word_embeddings and "lm_head.weight" not in out:
        embedding = [name for name in out if name.endswith("embed_tokens.weight") or name.endswith("wte.weight")]
        if embedding:
            out["lm_head.weight"] = out[embedding[0]]
    return out


def _is_weight_file(name: str) -> bool:
    return name.startswith(WEIGHT_FILE_PREFIXES)


def _into_folder(out_dir: str | os.PathLike, fill) -> None:
    """`fill(staging)` writes a transformers folder's files; they go into `out_dir`, which may hold
    other files (a tokenizer, a Megatron checkpoint): those are kept.  Files are renamed in one at
    a time, config.json last; weight files of an earlier save that this one does not write are
    removed -- a second save overwrites the first."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir, prefix=".hf-weights.partial-"))
    try:
        fill(staging)
        new = sorted(p.name for p in staging.iterdir())
        for old in out_dir.iterdir():
            if old.is_file() and _is_weight_file(old.name) and old.name not in new:
                old.unlink()
        for name in sorted(new, key=lambda n: n == "config.json"):  # config.json last
            os.replace(staging / name, out_dir / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_hf_folder(full: dict[str, torch.Tensor], config, out_dir: str | os.PathLike,
                    max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None) -> None:
    """Full megatron-core tensors -> safetensors under transformers' names + config.json +
    generation_config.json in `out_dir` (see `_into_folder`)."""
    dtype = dtype or next(iter(full.values())).dtype

    def fill(staging: Path) -> None:
        write_hf_weights(staging, config, full.__getitem__, dtype, max_shard_size)
        write_hf_config(staging, config, dtype, None)

    _into_folder(out_dir, fill)


def save_pretrained_here(model, save_directory, is_main_process: bool | None = None, state_dict=None,
                         save_function=None, push_to_hub: bool = False, max_shard_size="5GB",
                         safe_serialization: bool = True, **kwargs) -> None:
    """`save_pretrained` of an unwrapped model: the process the caller names writes.

    transformers 5's own save_pretrained writes only on torch.distributed rank 0, whatever
    `is_main_process` says; under Megatron-LM accelerate's main process is the last rank, so
    `save_pretrained(dir, is_main_process=accelerator.is_main_process)` would write nothing.
    Here the process with is_main_process=True (default: accelerate's main process) writes
    safetensors (`save_function` is not needed), config.json and generation_config.json.  A rank
    given an empty state_dict (`accelerator.get_state_dict` off the main process) writes nothing:
    it must not replace the main process's weights with a folder of only config.json."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from ...errors import ConfigError
    if push_to_hub or not safe_serialization:
        raise ConfigError("unwrap_model(model).save_pretrained: push_to_hub / safe_serialization=False are not "
                          "supported under Megatron-LM; save, then push the folder with hf-megatron push")
    if is_main_process is None:
        from accelerate.state import PartialState
        is_main_process = PartialState().is_main_process  # under MEGATRON_LM: the last rank
    if not is_main_process or (state_dict is not None and len(state_dict) == 0):
        return
    tensors = dict(state_dict if state_dict is not None else model.state_dict())
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # tied: stored once, as transformers does
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}

    def fill(staging: Path) -> None:
        plan = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
        for file, names in plan.filename_to_tensors.items():
            save_file({n: tensors[n] for n in names}, str(staging / file), metadata={"format": "pt"})
        if plan.is_sharded:
            index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
            (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        model.config.save_pretrained(staging)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(staging)

    _into_folder(save_directory, fill)


def transformers_model(full: dict[str, torch.Tensor], config, hf_config):
    """A transformers model (the user's config) holding these weights."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    weights = hf_state_dict(full, config)
    dtype = next(iter(weights.values())).dtype
    with init_empty_weights():  # parameters on meta (filled below), buffers (rotary tables) real
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if unexpected or [name for name in missing if name != "lm_head.weight"]:
        raise RuntimeError(f"internal error: gathered weights do not fit {type(model).__name__}: "
                           f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.tie_weights()
    # see save_pretrained_here: the process the caller names as main writes
    model.save_pretrained = functools.partial(save_pretrained_here, model)
    return model
