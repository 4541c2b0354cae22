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
over dp onto dp rank 0, in `distrib_optim.pt` next to it -- both as megatron-core 0.16.1's
DistributedOptimizer writes them (megatron_distrib_optim.py), the args recording the grad-buffer
flags that layout follows.  Loading also takes our earlier flat distrib_optim.pt
(optimizer_state.py) and the former ZeRO-1's per-dp-rank `optim_dp_RRR.pt` files, into either
optimizer.  All
files go to a staging folder first, which replaces the iteration folder in one step after every rank is done (also when that iteration
was saved before); then the tracker file is replaced: a crash never leaves a checkpoint that
looks complete, and the tracker never names a missing folder.

Works in one process and inside torch.distributed (collective: call it on every rank).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import rng
from ..checkpoint.args import build_args
from ..checkpoint.files import (MODEL_FILE, TRACKER, StagingDir, iter_dir_name, rank_dir_name,
                                resolve_iteration_dir, save_atomic, saved_layout, write_text_atomic)
from ..checkpoint.mcore import read_rank_file
from ..checkpoint.names import model_keys, to_stage_global, to_stage_local
from ..checkpoint.reader import info_entries
from ..checkpoint.torch_dist import COMMON_FILE
from ..checkpoint.unpickle import safe_load
from ..checkpoint.writer import rank_payload, write_rank_file
from ..errors import CheckpointError
from ..parallel import state
from ..parallel.random import get_tracker
from .megatron_distrib_optim import empty_megatron_state, training_layout, unwrap_model
from .megatron_optimizer_layout import set_schedule_bounds
from .optimizer_files import DISTRIB_OPTIM_FILE, kept_apart, optimizer_entry, parameter_state_of
from .torch_dist_resume import PARAMETER_STATE, is_torch_dist_folder, read_torch_dist
from .torch_dist_save import unsupported, write_torch_dist_iteration


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


# ------------------------------------------------------------------ RNG

def get_rng_state() -> dict[str, Any]:
    """This process's RNG entry in Megatron-LM's layout (hf_megatron.checkpoint.rng)."""
    return rng.capture(get_tracker().get_states(), state.get_state().coords["tp"])


def set_rng_state(entry: dict[str, Any]) -> None:
    """Restore what `get_rng_state` saved (or an older file of ours, or Megatron-LM's)."""
    tracker_states = rng.restore(entry)
    if tracker_states:
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


def _run_layout(chunks, iteration: int, optimizer, extra: dict[str, Any], has_rng: bool) -> dict[str, Any]:
    """What the args table needs to know about this run (hf_megatron.checkpoint.args.Layout)."""
    st = state.get_state()
    params = [p for m in chunks for p in m.parameters() if p.is_floating_point()]
    layout = dict(tp=st.tp, pp=st.pp, vpp=len(chunks) if len(chunks) > 1 else None, dp=st.dp, cp=st.cp,
                  iteration=iteration, params_dtype=params[0].dtype if params else torch.float32,
                  sequence_parallel=any(getattr(mod, "sequence_parallel", False) for m in chunks for mod in m.modules()),
                  has_optimizer=optimizer is not None, has_rng=has_rng)
    for key in ("consumed_train_samples", "consumed_valid_samples"):  # Megatron-LM reads them from args
        if isinstance(extra.get(key), int):
            layout[key] = extra[key]
    return layout


def save_checkpoint(save_dir: str | os.PathLike, iteration: int, model_chunks, optimizer=None, scheduler=None,
                    extra: dict[str, Any] | None = None, args: dict[str, Any] | None = None,
                    rng_state: dict[str, Any] | None = None, ckpt_format: str = "torch",
                    save_optim: bool = True, save_rng: bool = True) -> Path:
    """Write iteration `iteration`; returns its folder.  `extra` entries are stored at the top
    level of every file; the model card of `hf-megatron push` reports `consumed_train_samples`,
    `train_tokens` and `final_loss` from there.  `args` entries override or add to the Megatron
    `args` namespace (e.g. seq_length).  Re-saving an iteration replaces it whole; entries of
    `extra` / `args` given as None keep the value the earlier save recorded.  `rng_state`: this
    process's RNG entry (default: the current state; training/deferred.py passes the one its
    returned step left).  `ckpt_format="torch_dist"`: megatron-core's torch_dist folder instead of the
    rank files (torch_dist_save.py; any tp / pp, no distributed optimizer).  `save_optim=False` /
    `save_rng=False`: Megatron-LM's --no-save-optim (no optimizer, opt_param_scheduler, distrib_optim.pt)
    / --no-save-rng (no rng_state)."""
    chunks = [unwrap_model(m) for m in _chunks(model_chunks)]
    tp_rank, pp_rank, pp_size, dp_rank, cp_rank = _coords()
    final = Path(save_dir) / iter_dir_name(iteration)
    if ckpt_format == "torch_dist":
        why = unsupported(getattr(optimizer, "sharded", False))
        if why or len(chunks) > 1:
            raise CheckpointError(why or "--ckpt-format torch_dist: train writes it with one model chunk only")
    is_first = not _distributed() or dist.get_rank() == 0
    staging = StagingDir(final, allow_existing=True, shared=True, create=is_first)
    _barrier()

    if not save_optim:  # Megatron-LM's --no-save-optim
        optimizer, scheduler = None, None
    sharded = getattr(optimizer, "sharded", False)
    rank_rng = [rng_state or get_rng_state()] if save_rng else None
    rank_dir = staging.path / rank_dir_name(tp_rank, pp_rank, pp_size)
    if dp_rank == 0:
        extra, args = dict(extra or {}), dict(args or {})
        if sharded:  # the flags distrib_optim.pt's layout follows, recorded with it
            args = {**optimizer.megatron_args(), **args}
        _keep_recorded(final / (COMMON_FILE if ckpt_format == "torch_dist" else f"{rank_dir.name}/{MODEL_FILE}"),
                       extra, args)
        layout = _run_layout(chunks, iteration, optimizer, extra, save_rng)
        megatron_args = build_args(chunks[0].config, **{**layout, **args, "ckpt_format": ckpt_format})
    # state_dict() / parameter_state() may be collective (dp gathers): every rank calls them
    optim_state = optimizer.state_dict() if optimizer is not None else None
    if optim_state is not None and hasattr(scheduler, "min_lr"):  # megatron-core's scheduler reads them per group
        set_schedule_bounds(optim_state, scheduler.max_lr, scheduler.min_lr)
    param_state = None
    if sharded:  # megatron-core's distrib_optim.pt, gathered onto dp rank 0 (megatron_distrib_optim.py)
        param_state, place = empty_megatron_state(training_layout(chunks, megatron_args, pp_rank)) \
            if dp_rank == 0 else (None, None)
        optimizer.parameter_state(place)
    if ckpt_format == "torch_dist":  # a collective: every rank's shards onto global rank 0, which writes
        write_torch_dist_iteration(staging.path, chunks[0], optimizer, megatron_args if is_first else None,
                                   iteration, extra, rank_rng, optim_state,
                                   scheduler.state_dict() if scheduler is not None else None)
    elif dp_rank == 0 and cp_rank == 0:
        states = [to_stage_local(m.state_dict(), m.layer_numbers) for m in chunks]  # in memory: global numbers
        payload = rank_payload(states, megatron_args, iteration, extra, rng_state=rank_rng,
                               optimizer=optim_state,
                               opt_param_scheduler=scheduler.state_dict() if scheduler is not None else None)
        write_rank_file(rank_dir, payload)
        if param_state is not None:
            save_atomic(param_state, rank_dir / DISTRIB_OPTIM_FILE)
    _barrier()
    if is_first:
        staging.commit()
        write_text_atomic(Path(save_dir) / TRACKER, str(iteration))
    _barrier()
    return final


# ------------------------------------------------------------------ load

def _check_layout(saved_args: Any, path: Path, load_dir=None) -> None:
    st = state.get_state()
    saved_tp = getattr(saved_args, "tensor_model_parallel_size", None)
    saved_pp = getattr(saved_args, "pipeline_model_parallel_size", None)
    if (saved_tp, saved_pp) != (None, None) and (saved_tp, saved_pp) != (st.tp, st.pp):
        source = load_dir if load_dir is not None else "SRC"
        raise CheckpointError(f"{path}: saved with tp={saved_tp}, pp={saved_pp} but this run has tp={st.tp}, "
                              f"pp={st.pp}; reshard it first (README: Resume in another layout): `hf-megatron reshard "
                              f"--src {source} --out NEW --tp {st.tp} --pp {st.pp} --with-optimizer`, then --load NEW")


SCHEDULER_SHAPE = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")


def restore_scheduler(scheduler, saved: dict, path: Path, policy: str = "check") -> None:
    """Megatron-LM's rule for a checkpoint's `opt_param_scheduler`: the step count always comes from
    the checkpoint; the schedule's shape (peak and floor lr, warmup and decay in samples, style)
    must equal the flags' (`policy="check"`, the default), or is taken from the flags
    ("override": --override-opt_param-scheduler) or from the checkpoint ("checkpoint":
    --use-checkpoint-opt_param-scheduler).  A changed global batch size changes the shape in
    samples, so it is refused unless one of the two flags says which side wins."""
    ours = scheduler.state_dict()
    if policy == "check":
        diff = [f"{k} {saved.get(k)!r} in the checkpoint vs {ours[k]!r} from the flags" for k in SCHEDULER_SHAPE
                if k in saved and saved[k] != ours[k]]
        if diff:
            raise CheckpointError(f"{path}: the LR schedule differs from the checkpoint's ({'; '.join(diff)}); give "
                                  "--override-opt_param-scheduler to use the flags' or "
                                  "--use-checkpoint-opt_param-scheduler to use the checkpoint's")
    n = scheduler.samples_per_iter
    if policy == "checkpoint":
        try:
            scheduler.max_lr, scheduler.min_lr = float(saved["max_lr"]), float(saved["min_lr"])
            scheduler.warmup_iters = float(saved["lr_warmup_steps"]) / n
            scheduler.decay_iters = float(saved["lr_decay_steps"]) / n
            scheduler.decay_style = str(saved["lr_decay_style"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: opt_param_scheduler lacks the schedule's shape ({', '.join(SCHEDULER_SHAPE)})"
                                  "; --use-checkpoint-opt_param-scheduler cannot be used with it") from None
    try:
        scheduler.load_state_dict(saved)
    except ValueError as exc:  # e.g. samples seen not a whole number of the new global batches
        raise CheckpointError(f"{path}: {exc}") from None


def _check_shapes(weights: dict, chunk, path, key: str) -> None:
    """A checkpoint of a differently shaped model: one line naming the first tensor that differs,
    its shape in the checkpoint and in the model (this rank's shard of each)."""
    own = chunk.state_dict()
    wrong = [(name, tuple(value.shape), tuple(own[name].shape)) for name, value in weights.items()
             if isinstance(value, torch.Tensor) and isinstance(own.get(name), torch.Tensor)
             and value.shape != own[name].shape]
    if wrong:
        name, theirs, ours = wrong[0]
        more = f" (and {len(wrong) - 1} more tensors)" if len(wrong) > 1 else ""
        raise CheckpointError(f"{path}: does not fit the model ({key!r}): {name} is {list(theirs)} in the "
                              f"checkpoint, {list(ours)} in the model{more}; saved from another model config?")


def load_checkpoint(load_dir: str | os.PathLike, model_chunks, optimizer=None, scheduler=None,
                    iteration: int | None = None, load_rng: bool = True, strict: bool = True,
                    scheduler_policy: str = "load", info: dict | None = None) -> int:
    """Restore model chunks (and optimizer, scheduler, RNG when given/saved); returns the iteration.

    `scheduler_policy`: "load" takes the saved step count as is; "check" / "override" /
    "checkpoint" apply Megatron-LM's shape rule (`restore_scheduler`).  `info`, when given, receives
    the file's non-tensor entries (iteration, args, consumed_train_samples, ..., rng_state)."""
    chunks = [unwrap_model(m) for m in _chunks(model_chunks)]
    tp_rank, pp_rank, pp_size, dp_rank, cp_rank = _coords()
    folder, resolved = resolve_iteration_dir(load_dir, iteration)
    torch_dist = is_torch_dist_folder(folder)  # megatron-core's global tensors: any layout (torch_dist_resume.py)
    if not torch_dist and not (folder / rank_dir_name(tp_rank, pp_rank, pp_size)).is_dir():
        saved_tp, saved_pp = saved_layout(folder)  # this rank's folder is missing: another layout?
        if saved_tp:
            _check_layout(argparse.Namespace(tensor_model_parallel_size=saved_tp, pipeline_model_parallel_size=saved_pp),
                          folder, load_dir)
    payload, iteration, path = read_torch_dist(folder, resolved, chunks, optimizer) if torch_dist else \
        read_rank_file(load_dir, tp_rank, pp_rank, pp_size, iteration)
    if info is not None:
        info.update(info_entries(payload), rng_state=payload.get("rng_state"), path=path)
    if not torch_dist:
        _check_layout(payload.get("args"), path, load_dir)
    for key, chunk in zip(model_keys(len(chunks)), chunks):
        if not isinstance(payload.get(key), dict):
            raise CheckpointError(f"{path}: no {key!r} entry (found {sorted(k for k in payload if str(k).startswith('model'))}); "
                                  f"saved with a different number of virtual pipeline chunks?")
        # megatron-core's modules save an `_extra_state` entry (TE / fp8 metadata; None for the local spec)
        weights = to_stage_global({k: v for k, v in payload[key].items() if not str(k).endswith("._extra_state")},
                                  chunk.layer_numbers)
        _check_shapes(weights, chunk, path, key)
        try:
            result = chunk.load_state_dict(weights, strict=False)
        except (RuntimeError, TypeError) as exc:  # shapes or entries that are not tensors
            raise CheckpointError(f"{path}: {key} does not fit the model ({str(exc).strip().splitlines()[0]})") from None
        if strict and (result.missing_keys or result.unexpected_keys):
            raise CheckpointError(f"{path}: {key} holds other tensors than this run's model: the model has "
                                  f"{result.missing_keys[:4]} which the checkpoint lacks, the checkpoint has "
                                  f"{result.unexpected_keys[:4]} which the model lacks")
    if optimizer is not None:
        _load_optimizer_state(optimizer, payload, path, pp_rank)
    if scheduler is not None and isinstance(payload.get("opt_param_scheduler"), dict):
        if scheduler_policy == "load":
            scheduler.load_state_dict(payload["opt_param_scheduler"])
        else:
            restore_scheduler(scheduler, payload["opt_param_scheduler"], path, scheduler_policy)
    if load_rng:
        restore_rng(payload.get("rng_state"))
    return 0 if iteration == "release" else int(iteration)


def restore_rng(saved) -> bool:
    """Set this rank's RNG streams from a file's `rng_state` entry; False when there is none.
    Megatron stores a list (one entry per dp rank with --data-parallel-random-init, else one)."""
    if not saved:
        return False
    rng = saved if isinstance(saved, list) else [saved]
    dp_rank = _coords()[3]
    set_rng_state(rng[dp_rank] if dp_rank < len(rng) else rng[0])
    return True


NO_OPTIMIZER_STATE = "load it without an optimizer (--finetune or --no-load-optim)"  # optimizer_entry's remedy


def _load_optimizer_state(optimizer, payload: dict, path: Path, pp_rank: int = 0) -> None:
    """Whichever optimizer layout the rank folder holds, into whichever optimizer this run has:
    the parameter state torch_dist_resume read, or optimizer_files.parameter_state_of's (distrib_optim.pt,
    the former ZeRO-1's optim_dp_RRR.pt files, or for a distributed optimizer the full state of
    model_optim_rng.pt); a plain optimizer reads a full state itself."""
    if PARAMETER_STATE in payload:  # torch_dist: megatron-core's distributed optimizer, read by torch_dist_resume
        optimizer.load_state_dict(payload["optimizer"], parameter_state=payload[PARAMETER_STATE])
    elif getattr(optimizer, "sharded", False) or kept_apart(path.parent):
        layout = lambda: training_layout(optimizer.chunks, payload.get("args"), pp_rank)  # noqa: E731
        entry, parameter_state = parameter_state_of(path, payload, optimizer.model_params,
                                                    getattr(optimizer, "megatron_order", None), layout,
                                                    NO_OPTIMIZER_STATE)
        optimizer.load_state_dict(entry, parameter_state=parameter_state)
    else:
        optimizer.load_state_dict(optimizer_entry(payload, path, NO_OPTIMIZER_STATE))


def checkpoint_info(load_dir: str | os.PathLike, iteration: int | None = None) -> dict[str, Any]:
    """Everything but the tensors of rank (0, 0)'s file (torch_dist: of common.pt): args, iteration, extra entries."""
    folder, _ = resolve_iteration_dir(load_dir, iteration)
    if is_torch_dist_folder(folder):
        info = info_entries(safe_load(folder / "common.pt"))
    else:
        _, pp = saved_layout(folder)
        payload, iteration, _ = read_rank_file(load_dir, 0, 0, max(pp, 1), iteration)
        info = info_entries(payload)
    if isinstance(info.get("args"), argparse.Namespace):
        info["args"] = vars(info["args"])
    return info
