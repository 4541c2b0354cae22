"""What training puts into a Megatron-LM checkpoint and takes back: model chunks, optimizer,
LR scheduler, RNG streams and the data position (`extra`, e.g. consumed_train_samples).  The
format itself -- folder names, the rank file, staging, safe loading -- is hf_megatron.checkpoint.

    <save_dir>/latest_checkpointed_iteration.txt                     written last
    <save_dir>/iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt
        model (or model0, model1, ... for virtual pipeline chunks), optimizer,
        opt_param_scheduler, rng_state, args, iteration, checkpoint_version = 3.0

Each model-parallel rank (tp, pp) with data-parallel rank 0 writes its own file, with layer
numbers local to its pipeline stage.  The distributed optimizer (`sharded = True`) keeps param
groups and loss scaler in model_optim_rng.pt and its main weights and Adam moments, gathered
over dp onto dp rank 0, in `distrib_optim.pt` next to it (Megatron-LM's layout).  Loading also
takes the former ZeRO-1's per-dp-rank `optim_dp_RRR.pt` files, into either optimizer.  All
files go to a staging folder first, which replaces the iteration folder in one step after every rank is done (also when that iteration
was saved before); then the tracker file is replaced: a crash never leaves a checkpoint that
looks complete, and the tracker never names a missing folder.

Works in one process and inside torch.distributed (collective: call it on every rank).
"""
from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint.args import build_args
from ..checkpoint.files import (MODEL_FILE, TRACKER, StagingDir, iter_dir_name, optim_file_name, rank_dir_name,
                                resolve_iteration_dir, save_atomic, saved_layout, write_text_atomic)
from ..checkpoint.mcore import read_rank_file
from ..checkpoint.names import model_keys, to_stage_global, to_stage_local
from ..checkpoint.reader import info_entries
from ..checkpoint.unpickle import safe_load
from ..checkpoint.writer import rank_payload, write_rank_file
from ..errors import CheckpointError
from ..parallel import state
from ..parallel.random import get_tracker
from .optimizer_state import parameter_state_from

DISTRIB_OPTIM_FILE = "distrib_optim.pt"  # Megatron-LM's name: the distributed optimizer's state, from dp rank 0


def _chunks(model_chunks) -> list[torch.nn.Module]:
    return list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]


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

def _keep_recorded(previous: Path, extra: dict[str, Any], args: dict[str, Any]) -> None:
    """A re-save of an iteration fills the entries it passes as None (a loss not known this
    time, say) with what the previous save of that rank file recorded."""
    if not previous.is_file() or not any(v is None for v in (*extra.values(), *args.values())):
        return
    old = safe_load(previous, mmap=True)
    old_args = old.get("args")
    for key in [k for k, v in extra.items() if v is None]:
        extra[key] = old.get(key)
    for key in [k for k, v in args.items() if v is None]:
        args[key] = getattr(old_args, key, None)


def save_checkpoint(save_dir: str | os.PathLike, iteration: int, model_chunks, optimizer=None, scheduler=None,
                    extra: dict[str, Any] | None = None, args: dict[str, Any] | None = None) -> Path:
    """Write iteration `iteration`; returns its folder.  `extra` entries are stored at the top
    level of every file; the model card of `hf-megatron push` reports `consumed_train_samples`,
    `train_tokens` and `final_loss` from there.  `args` entries override or add to the Megatron
    `args` namespace (e.g. seq_length).  Re-saving an iteration replaces it whole; entries of
    `extra` / `args` given as None keep the value the earlier save recorded."""
    chunks = [_unwrap(m) for m in _chunks(model_chunks)]
    tp_rank, pp_rank, pp_size, dp_rank, cp_rank = _coords()
    st = state.get_state()
    final = Path(save_dir) / iter_dir_name(iteration)
    is_first = not _distributed() or dist.get_rank() == 0
    staging = StagingDir(final, allow_existing=True, shared=True, create=is_first)
    _barrier()

    # state_dict() / parameter_state() may be collective (dp gathers): every rank calls them
    optim_state = optimizer.state_dict() if optimizer is not None else None
    param_state = optimizer.parameter_state() if getattr(optimizer, "sharded", False) else None
    rank_dir = staging.path / rank_dir_name(tp_rank, pp_rank, pp_size)
    if dp_rank == 0 and cp_rank == 0:
        extra, args = dict(extra or {}), dict(args or {})
        _keep_recorded(final / rank_dir.name / MODEL_FILE, extra, args)
        megatron_args = build_args(chunks[0].config, tp=st.tp, pp=st.pp, vpp=len(chunks) if len(chunks) > 1 else None,
                                   dp=st.dp, context_parallel_size=st.cp, iteration=iteration, **args)
        states = [to_stage_local(m.state_dict(), m.layer_numbers) for m in chunks]  # in memory: global numbers
        payload = rank_payload(states, megatron_args, iteration, extra, rng_state=[get_rng_state()],
                               optimizer=optim_state,
                               opt_param_scheduler=scheduler.state_dict() if scheduler is not None else None)
        write_rank_file(rank_dir, payload)
    if param_state is not None and cp_rank == 0:  # dp rank 0 holds the gathered state
        rank_dir.mkdir(exist_ok=True)
        save_atomic(param_state, rank_dir / DISTRIB_OPTIM_FILE)
    _barrier()
    if is_first:
        staging.commit()
        write_text_atomic(Path(save_dir) / TRACKER, str(iteration))
    _barrier()
    return final


# ------------------------------------------------------------------ load

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
    payload, iteration, path = read_rank_file(load_dir, tp_rank, pp_rank, pp_size, iteration)
    _check_layout(payload.get("args"), path)
    for key, chunk in zip(model_keys(len(chunks)), chunks):
        if not isinstance(payload.get(key), dict):
            raise CheckpointError(f"{path}: no {key!r} entry (found {sorted(k for k in payload if str(k).startswith('model'))}); "
                                  f"saved with a different number of virtual pipeline chunks?")
        try:
            result = chunk.load_state_dict(to_stage_global(payload[key], chunk.layer_numbers), strict=False)
        except (RuntimeError, TypeError) as exc:  # shapes or entries that are not tensors
            raise CheckpointError(f"{path}: {key} does not fit the model ({str(exc).strip().splitlines()[0]})") from None
        if strict and (result.missing_keys or result.unexpected_keys):
            raise CheckpointError(f"{path}: {key} does not match the model: missing {result.missing_keys[:4]}, "
                                  f"unexpected {result.unexpected_keys[:4]}")
    if optimizer is not None:
        _load_optimizer_state(optimizer, payload, path)
    if scheduler is not None and "opt_param_scheduler" in payload:
        scheduler.load_state_dict(payload["opt_param_scheduler"])
    if load_rng and payload.get("rng_state"):
        # Megatron stores a list (one entry per dp rank with --data-parallel-random-init, else one)
        rng = payload["rng_state"] if isinstance(payload["rng_state"], list) else [payload["rng_state"]]
        set_rng_state(rng[dp_rank] if dp_rank < len(rng) else rng[0])
    return 0 if iteration == "release" else int(iteration)


def _load_optimizer_state(optimizer, payload: dict, path: Path) -> None:
    """Whichever optimizer layout the rank folder holds, into whichever optimizer this run has:
    distrib_optim.pt (the distributed optimizer), the former ZeRO-1's optim_dp_RRR.pt files,
    or a full state inside model_optim_rng.pt (optimizer_state.py converts between them)."""
    folder = path.parent
    zero1_files = sorted(folder.glob("optim_dp_*.pt"))
    if (folder / DISTRIB_OPTIM_FILE).is_file():
        if "optimizer" not in payload:
            raise CheckpointError(f"{path}: no optimizer entry (param groups, loss scaler) beside {DISTRIB_OPTIM_FILE}")
        optimizer.load_state_dict(payload["optimizer"], parameter_state=safe_load(folder / DISTRIB_OPTIM_FILE))
    elif zero1_files:
        if [f.name for f in zero1_files] != [optim_file_name(r) for r in range(len(zero1_files))]:
            raise CheckpointError(f"{folder}: optimizer files {[f.name for f in zero1_files]} are not "
                                  f"optim_dp_000.pt .. optim_dp_{len(zero1_files) - 1:03d}.pt")
        states = [safe_load(f)["optimizer"] for f in zero1_files]
        optimizer.load_state_dict(states[0], parameter_state=parameter_state_from(states, optimizer.model_params))
    elif "optimizer" not in payload:
        raise CheckpointError(f"{path}: holds no optimizer state (a converted or weights-only checkpoint); "
                              f"load it without an optimizer")
    elif getattr(optimizer, "sharded", False):
        state = payload["optimizer"]
        optimizer.load_state_dict(state, parameter_state=parameter_state_from([state], optimizer.model_params))
    else:
        optimizer.load_state_dict(payload["optimizer"])


def checkpoint_info(load_dir: str | os.PathLike, iteration: int | None = None) -> dict[str, Any]:
    """Everything but the tensors of rank (0, 0)'s file: args, iteration, extra entries."""
    folder, _ = resolve_iteration_dir(load_dir, iteration)
    _, pp = saved_layout(folder)
    payload, iteration, _ = read_rank_file(load_dir, 0, 0, max(pp, 1), iteration)
    info = info_entries(payload)
    if isinstance(info.get("args"), argparse.Namespace):
        info["args"] = vars(info["args"])
    return info
