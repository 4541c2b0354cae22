"""`accelerator.save_state` / `load_state` under Megatron-LM: a complete, resumable checkpoint.

    <output_dir>/latest_checkpointed_iteration.txt         Megatron-LM's layout (training/checkpoint.py):
    <output_dir>/iter_0000012/mp_rank_TT[_PPP]/model_optim_rng.pt   every model-parallel rank its shard:
        model, optimizer, opt_param_scheduler, rng_state, args, iteration, and as extra entries
        consumed_train_samples, accelerate_step, dataloaders (each prepared loader's position,
        loaders.py), user_scheduler (a torch schedule the engine follows)
    <output_dir>/model.safetensors + config.json + generation_config.json
        the same weights under transformers' names: `AutoModelForCausalLM.from_pretrained(output_dir)`
        loads the folder (the Megatron files beside them are ignored by it)

Saving the same folder again replaces the iteration folder and the tracker atomically and the
transformers files one by one (weights.py).  `load_state` restores model, optimizer, schedule,
RNG streams, the engine's iteration and samples, accelerate's step counter and the loaders'
positions; a model prepared from `init_empty_weights` gets its weights here.

The rest is accelerate's own `save_state` / `load_state`: `register_for_checkpointing` objects as
`custom_checkpoint_<i>.pkl` (their `state_dict()`, written by the main process; loaded back on every
rank by our allow-list unpickler -- accelerate's `load_custom_state` unpickles anything; a state
holding another type than tensors, containers and plain values is refused in one line), the save / load
pre-hooks (called as accelerate's Megatron-LM path calls them: no weights list, no models on load),
`ProjectConfiguration(automatic_checkpoint_naming=True)`: every save goes to
`<project_dir>/checkpoints/checkpoint_<save_iteration>` (a given folder is ignored, as in accelerate),
`total_limit` removes the oldest first, and `load_state()` reads the newest; every save counts
`project_configuration.iteration` up.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ...checkpoint.unpickle import safe_load
from ...errors import ConfigError
from ...training.checkpoint import checkpoint_info, load_checkpoint, save_checkpoint
from .engine import _generators, _set_generators
from .loaders import PositionedLoader
from .weights import gather_full, write_hf_folder


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _number(folder: Path) -> int | None:
    """accelerate's order of checkpoint folders: the last number in the name."""
    found = re.findall(r"[0-9]+", folder.name)
    return int(found[-1]) if found else None


def _auto_root(accelerator) -> Path:
    return Path(accelerator.project_dir) / "checkpoints"


def _save_folder(accelerator, output_dir) -> Path:
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        if output_dir is None:
            raise ConfigError("accelerator.save_state(output_dir): give a folder "
                              "(or ProjectConfiguration(automatic_checkpoint_naming=True))")
        return Path(output_dir)
    root = _auto_root(accelerator)
    folder = root / f"checkpoint_{accelerator.save_iteration}"
    if folder.exists():  # every rank sees it before anything is removed or written
        raise ConfigError(f"accelerator.save_state(): {folder} already exists; set "
                          f"accelerator.project_configuration.iteration to the next free number")
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        if config.total_limit is not None:
            numbered = sorted((p for p in root.iterdir() if _number(p) is not None), key=_number)
            for old in numbered[:max(len(numbered) + 1 - config.total_limit, 0)]:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
    _barrier()
    return folder


def _load_folder(accelerator, input_dir) -> Path:
    if input_dir is not None:
        folder = Path(input_dir).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"accelerator.load_state: {folder} is not a folder")
        return folder
    if not accelerator.project_configuration.automatic_checkpoint_naming:
        raise ConfigError("accelerator.load_state(input_dir): give a folder "
                          "(or ProjectConfiguration(automatic_checkpoint_naming=True))")
    root = _auto_root(accelerator)
    done = sorted((p for p in root.glob("checkpoint_*") if _number(p) is not None), key=_number)
    if not done:
        raise ConfigError(f"accelerator.load_state(): no checkpoint_* folder in {root}")
    return done[-1]


def _custom_files(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if re.fullmatch(r"custom_checkpoint_\d+\.pkl", p.name)]


def _save_custom_objects(accelerator, folder: Path) -> None:
    """accelerate's save_custom_state, written atomically (temp + rename) by the main process
    (every node's local main with `save_on_each_node`)."""
    on_each_node = accelerator.project_configuration.save_on_each_node
    if not (accelerator.is_local_main_process if on_each_node else accelerator.is_main_process):
        return
    for index, obj in enumerate(accelerator._custom_objects):
        target = folder / f"custom_checkpoint_{index}.pkl"
        partial = target.with_name(f".{target.name}.partial")
        torch.save(obj.state_dict(), partial)
        os.replace(partial, target)
    for stale in _custom_files(folder):  # an earlier save into this folder registered more objects
        if int(re.findall(r"[0-9]+", stale.name)[-1]) >= len(accelerator._custom_objects):
            stale.unlink()


def _load_custom_objects(accelerator, folder: Path) -> None:
    found = len(_custom_files(folder))
    if found != len(accelerator._custom_objects):
        raise ConfigError(f"accelerator.load_state: {folder} holds {found} custom_checkpoint_*.pkl file(s) but "
                          f"{len(accelerator._custom_objects)} object(s) are registered with "
                          f"register_for_checkpointing; register the same objects as when it was saved")
    for index, obj in enumerate(accelerator._custom_objects):
        # accelerate unpickles these with weights_only=False; ours runs no code named in the file: tensors,
        # containers and plain values load, anything else is one line naming the file and the type
        obj.load_state_dict(safe_load(folder / f"custom_checkpoint_{index}.pkl"))


def save_state(accelerator, engine, output_dir=None) -> str:
    folder = _save_folder(accelerator, output_dir)
    for hook in accelerator._save_model_state_pre_hook.values():
        hook(accelerator._models, [], os.fspath(folder))  # as accelerate's Megatron-LM path: no weights list
    chunks = list(engine.chunks)
    extra = {"consumed_train_samples": engine.consumed_train_samples, "accelerate_step": accelerator.step,
             "dataloaders": [dl.position() if isinstance(dl, PositionedLoader) else {}
                             for dl in accelerator._dataloaders]}
    if engine.user_scheduler is not None:
        extra["user_scheduler"] = engine.user_scheduler.state_dict()
    with engine.rng.active():  # the checkpoint's torch RNG entry is the engine's stream (the steps' dropout)
        save_checkpoint(folder, engine.iteration, chunks, engine.optimizer, engine.scheduler, extra=extra)
    # the user's own torch generators, as accelerate's random_states_<process>.pkl keeps them
    torch.save(_generators(), folder / f"user_torch_rng_{dist.get_rank() if dist.is_initialized() else 0}.pt")
    full = gather_full(chunks, dst=accelerator.num_processes - 1, optimizer=engine.optimizer)  # the main process: the last rank
    if full is not None:
        write_hf_folder(full, chunks[0].config, folder)
    _save_custom_objects(accelerator, folder)
    _barrier()
    accelerator.project_configuration.iteration += 1  # accelerate counts every save
    return os.fspath(folder)


def load_state(accelerator, engine, input_dir=None) -> None:
    folder = _load_folder(accelerator, input_dir)
    for hook in accelerator._load_model_state_pre_hook.values():
        hook([], os.fspath(folder))  # as accelerate's Megatron-LM path: the engine loads itself
    chunks = list(engine.chunks)
    _barrier()
    with engine.rng.active():
        engine.iteration = load_checkpoint(folder, chunks, engine.optimizer, engine.scheduler)
    user_rng = folder / f"user_torch_rng_{dist.get_rank() if dist.is_initialized() else 0}.pt"
    if user_rng.is_file():  # restored as accelerate's load_state restores random_states_<process>.pkl
        _set_generators(safe_load(user_rng))
    info = checkpoint_info(folder)
    engine.consumed_train_samples = int(info.get("consumed_train_samples") or 0)
    engine._accumulated = 0
    accelerator.step = int(info.get("accelerate_step") or 0)
    if engine.user_scheduler is not None and info.get("user_scheduler") is not None:
        engine.user_scheduler.load_state_dict(info["user_scheduler"])
        # plain accelerate restores the optimizer the schedule was built on: a schedule built on the
        # user's own optimizer (not the prepared one) gets the loaded lr / betas there too (what a
        # chainable schedule's next step reads, and what the engine follows from then on)
        user_groups = engine.user_scheduler.optimizer.param_groups
        if user_groups is not engine.optimizer.param_groups:
            for group in engine.optimizer.param_groups:
                user = user_groups[group.get("user_group", 0)]
                user["lr"] = group["lr"]
                if "betas" in user and "betas" in group:
                    user["betas"] = tuple(group["betas"])
    for loader, saved in zip(accelerator._dataloaders, info.get("dataloaders") or []):
        if isinstance(loader, PositionedLoader) and saved:
            loader.restore(saved)
    _load_custom_objects(accelerator, folder)
    _barrier()
