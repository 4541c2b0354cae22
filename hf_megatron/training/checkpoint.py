"""Save and resume training in Megatron-LM's checkpoint layout.

    <save_dir>/latest_checkpointed_iteration.txt                     written last
    <save_dir>/iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt
        model (or model0, model1, ... for virtual pipeline chunks), optimizer,
        opt_param_scheduler, rng_state, args, iteration, checkpoint_version = 3.0

Each model-parallel rank (tp, pp) with data-parallel rank 0 writes its own file, with layer
numbers local to its pipeline stage.  An optimizer whose `state_dict()` differs per
data-parallel rank (ZeRO) sets `state_dict_per_dp_rank = True`; then every data-parallel rank
also writes `optim_dp_RRR.pt` next to it.  All files go to `.iter_XXXXXXX.partial` first; the
folder is renamed into place after every rank is done, then the tracker file is replaced:
a crash never leaves a checkpoint that looks complete.

Works in one process and inside torch.distributed (collective: call it on every rank).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..conversion.hf_io import CheckpointError
from ..conversion.megatron_args import build_args
from ..conversion.megatron_files import (MODEL_FILE, TRACKER, iter_dir_name, rank_dir_name, resolve_iteration_dir,
                                         safe_load, save_atomic, saved_layout, write_text_atomic)
from ..conversion.layout import to_global_name, to_local_name
from ..conversion.megatron_writer import CHECKPOINT_VERSION
from ..parallel import state
from ..parallel.random import get_tracker



def stage_local_state_dict(chunk) -> dict[str, torch.Tensor]:
    """The chunk's state dict with layer numbers local to its stage, as Megatron writes them
    (in memory the model keeps global numbers)."""
    offset = min(chunk.layer_numbers, default=0)
    return {to_local_name(name, offset, len(chunk.layer_numbers)): t for name, t in chunk.state_dict().items()}


def stage_global_state_dict(saved: dict[str, torch.Tensor], chunk) -> dict[str, torch.Tensor]:
    offset = min(chunk.layer_numbers, default=0)
    return {to_global_name(name, offset): t for name, t in saved.items()}


def _chunks(model_chunks) -> list[torch.nn.Module]:
    return list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]


def _model_keys(n: int) -> list[str]:
    return ["model"] if n == 1 else [f"model{i}" for i in range(n)]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _coords() -> tuple[int, int, int, int, int]:
    """(tp_rank, pp_rank, pp_size, dp_rank, cp_rank) of this process."""
    st = state.get_state()
    return st.coords["tp"], st.coords["pp"], st.pp, st.coords["dp"], st.coords["cp"]


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module") and not hasattr(module, "config"):  # DDP and similar wrappers
        module = module.module
    return module


# ------------------------------------------------------------------ RNG

def get_rng_state() -> dict[str, Any]:
    np_name, np_keys, np_pos, np_gauss, np_cached = np.random.get_state()
    rng = {
        "random_rng_state": random.getstate(),
        # numpy's key array is kept as a tensor so the file loads with weights_only=True
        "np_rng_state": (np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_gauss, np_cached),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": get_tracker().get_states(),
    }
    if torch.cuda.is_available():
        rng["cuda_rng_state"] = torch.cuda.get_rng_state()
    return rng


def set_rng_state(rng: dict[str, Any]) -> None:
    """Restore what `get_rng_state` saved.  From a Megatron-LM file, parts we cannot use (its
    numpy array arrives as an inert stand-in, its tracker holds CUDA streams by other names)
    are skipped rather than guessed."""
    random.setstate(rng["random_rng_state"])
    name, keys, pos, gauss, cached = rng["np_rng_state"]
    if isinstance(keys, torch.Tensor):
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, gauss, cached))
    torch.set_rng_state(rng["torch_rng_state"])
    if torch.cuda.is_available() and rng.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(rng["cuda_rng_state"])
    tracker_states = rng.get("rng_tracker_states") or {}
    if "cpu" in tracker_states:
        get_tracker().set_states(tracker_states)


# ------------------------------------------------------------------ save

def save_checkpoint(save_dir: str | os.PathLike, iteration: int, model_chunks, optimizer=None, scheduler=None,
                    extra: dict[str, Any] | None = None, args: dict[str, Any] | None = None) -> Path:
    """Write iteration `iteration`; returns its folder.  `extra` entries are stored at the top
    level of every file; the model card of `hf-megatron push` reports `consumed_train_samples`,
    `train_tokens` and `final_loss` from there.  `args` entries override or add to the Megatron
    `args` namespace (e.g. seq_length)."""
    chunks = [_unwrap(m) for m in _chunks(model_chunks)]
    tp_rank, pp_rank, pp_size, dp_rank, cp_rank = _coords()
    st = state.get_state()
    root = Path(save_dir)
    final = root / iter_dir_name(iteration)
    staging = root / f".{final.name}.partial"
    is_first = not _distributed() or dist.get_rank() == 0
    if is_first:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    _barrier()

    # state_dict() may be collective (ZeRO consolidation): every rank calls it
    optim_state = optimizer.state_dict() if optimizer is not None else None
    per_dp = bool(getattr(optimizer, "state_dict_per_dp_rank", False))
    rank_dir = staging / rank_dir_name(tp_rank, pp_rank, pp_size)
    writer = dp_rank == 0 and cp_rank == 0
    if writer or (per_dp and cp_rank == 0):
        rank_dir.mkdir(exist_ok=True)
    if writer:
        vpp = len(chunks) if len(chunks) > 1 else None
        megatron_args = build_args(chunks[0].config, tp=st.tp, pp=st.pp, vpp=vpp, dp=st.dp,
                                   context_parallel_size=st.cp, iteration=iteration, **(args or {}))
        payload: dict[str, Any] = {key: stage_local_state_dict(m) for key, m in zip(_model_keys(len(chunks)), chunks)}
        payload.update(args=megatron_args, checkpoint_version=CHECKPOINT_VERSION, iteration=iteration,
                       rng_state=[get_rng_state()])
        if optim_state is not None and not per_dp:
            payload["optimizer"] = optim_state
        if scheduler is not None:
            payload["opt_param_scheduler"] = scheduler.state_dict()
        payload.update(extra or {})
        save_atomic(payload, rank_dir / MODEL_FILE)
    if per_dp and cp_rank == 0 and optim_state is not None:
        save_atomic({"optimizer": optim_state, "iteration": iteration}, rank_dir / f"optim_dp_{dp_rank:03d}.pt")
    _barrier()
    if is_first:
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        write_text_atomic(root / TRACKER, str(iteration))
    _barrier()
    return final


# ------------------------------------------------------------------ load

def read_checkpoint(load_dir: str | os.PathLike, tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1,
                    iteration: int | None = None) -> tuple[dict[str, Any], int | str, Path]:
    """(contents of one rank's model_optim_rng.pt, iteration, its file)."""
    folder, iteration = resolve_iteration_dir(load_dir, iteration)
    path = folder / rank_dir_name(tp_rank, pp_rank, pp_size) / MODEL_FILE
    if not path.parent.is_dir():
        tp, pp = saved_layout(folder)
        raise CheckpointError(f"{path.parent}: rank folder missing (the folder holds tp={tp}, pp={pp}; "
                              f"this run wants tp rank {tp_rank}, pp rank {pp_rank} of pp={pp_size})")
    return safe_load(path), iteration, path


def _check_layout(saved_args: Any, path: Path) -> None:
    st = state.get_state()
    saved_tp = getattr(saved_args, "tensor_model_parallel_size", None)
    saved_pp = getattr(saved_args, "pipeline_model_parallel_size", None)
    if (saved_tp, saved_pp) != (None, None) and (saved_tp, saved_pp) != (st.tp, st.pp):
        raise CheckpointError(f"{path}: saved with tp={saved_tp}, pp={saved_pp} but this run has tp={st.tp}, "
                              f"pp={st.pp}; convert it first with `hf-megatron reshard --tp {st.tp} --pp {st.pp}`")


def load_checkpoint(load_dir: str | os.PathLike, model_chunks, optimizer=None, scheduler=None,
                    iteration: int | None = None, load_rng: bool = True, strict: bool = True) -> int:
    """Restore model chunks (and optimizer, scheduler, RNG when given/saved); returns the iteration."""
    chunks = [_unwrap(m) for m in _chunks(model_chunks)]
    tp_rank, pp_rank, pp_size, dp_rank, cp_rank = _coords()
    payload, iteration, path = read_checkpoint(load_dir, tp_rank, pp_rank, pp_size, iteration)
    _check_layout(payload.get("args"), path)
    for key, chunk in zip(_model_keys(len(chunks)), chunks):
        if key not in payload:
            raise CheckpointError(f"{path}: no {key!r} entry (found {sorted(k for k in payload if k.startswith('model'))}); "
                                  f"saved with a different number of virtual pipeline chunks?")
        result = chunk.load_state_dict(stage_global_state_dict(payload[key], chunk), strict=False)
        if strict and (result.missing_keys or result.unexpected_keys):
            raise CheckpointError(f"{path}: {key} does not match the model: missing {result.missing_keys[:4]}, "
                                  f"unexpected {result.unexpected_keys[:4]}")
    if optimizer is not None:
        if getattr(optimizer, "state_dict_per_dp_rank", False):
            optim_state = safe_load(path.parent / f"optim_dp_{dp_rank:03d}.pt")["optimizer"]
        elif "optimizer" in payload:
            optim_state = payload["optimizer"]
        else:
            raise CheckpointError(f"{path}: holds no optimizer state (a converted or weights-only checkpoint); "
                                  f"load it without an optimizer")
        optimizer.load_state_dict(optim_state)
    if scheduler is not None and "opt_param_scheduler" in payload:
        scheduler.load_state_dict(payload["opt_param_scheduler"])
    if load_rng and payload.get("rng_state"):
        # Megatron stores a list (one entry per dp rank with --data-parallel-random-init, else one)
        rng = payload["rng_state"] if isinstance(payload["rng_state"], list) else [payload["rng_state"]]
        set_rng_state(rng[dp_rank] if dp_rank < len(rng) else rng[0])
    return 0 if iteration == "release" else int(iteration)


def checkpoint_info(load_dir: str | os.PathLike, iteration: int | None = None) -> dict[str, Any]:
    """Everything but the tensors of rank (0, 0)'s file: args, iteration, extra entries."""
    folder, _ = resolve_iteration_dir(load_dir, iteration)
    _, pp = saved_layout(folder)
    payload, iteration, _ = read_checkpoint(load_dir, 0, 0, max(pp, 1), iteration)
    skip = ("model", "optimizer", "opt_param_scheduler", "rng_state")
    info = {k: v for k, v in payload.items() if not k.startswith(skip)}
    if isinstance(info.get("args"), argparse.Namespace):
        info["args"] = vars(info["args"])
    return info
