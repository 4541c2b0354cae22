"""The prepared model's full weights under Hugging Face names, gathered over TP and PP.

Every rank of data-parallel rank 0 holds a shard: its pipeline stage's layers (global layer
numbers in memory), tensor-parallel slices by the architecture's plan.  `gather_full` collects
them on one rank (or all) and merges each tensor with the same plan that split it
(`parallel.sharding.merge_tensor`: TP concatenation, per-part for fused tensors, vocab padding
removed); the mapping table (`architectures.mcore_to_hf`) then gives transformers' names.  The
last stage's copy of tied word embeddings is dropped (it equals the first stage's).

These are collectives: every rank calls them.  Memory: the full model on the receiving rank(s),
on CPU.
"""
from __future__ import annotations

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


def _local_shard(chunks) -> dict[str, torch.Tensor]:
    grid = state.get_state()
    if grid.coords["dp"] != 0 or grid.coords["cp"] != 0:
        return {}  # data-parallel replicas hold the same values
    config = chunks[0].config
    local = {}
    for chunk in chunks:
        for name, tensor in chunk.state_dict().items():
            if name == "output_layer.weight" and config.tie_word_embeddings:
                continue  # the last stage's copy of the tied table
            local[name] = tensor.detach().to("cpu", copy=True)
    return local


def gather_full(chunks, dst: int | None) -> dict[str, torch.Tensor] | None:
    """Full megatron-core tensors on global rank `dst` (None: on every rank); None elsewhere."""
    config = chunks[0].config
    grid = state.get_state()
    mine = (grid.coords["tp"], _local_shard(chunks))
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


def write_hf_folder(full: dict[str, torch.Tensor], config, out_dir: str | os.PathLike,
                    max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None) -> None:
    """Weights (safetensors) + config.json + generation_config.json into `out_dir`, which may hold
    other files (a tokenizer, a Megatron checkpoint): they are kept.  Files are written to a
    hidden folder and renamed in one at a time, config last; weight files of an earlier save
    that this one does not write are removed -- a second save overwrites the first."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir, prefix=".hf-weights.partial-"))
    try:
        dtype = dtype or next(iter(full.values())).dtype
        write_hf_weights(staging, config, full.__getitem__, dtype, max_shard_size)
        write_hf_config(staging, config, dtype, None)
        new = sorted(p.name for p in staging.iterdir())
        for old in out_dir.iterdir():
            if old.is_file() and _is_weight_file(old.name) and old.name not in new:
                old.unlink()
        for name in sorted(new, key=lambda n: n == "config.json"):  # config.json last
            os.replace(staging / name, out_dir / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
    return model
