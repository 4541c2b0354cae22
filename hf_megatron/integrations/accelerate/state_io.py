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
positions; a model prepared from `init_empty_weights` gets its weights here.  accelerate's
`register_for_checkpointing` objects are not saved (one-line error).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from ...errors import ConfigError
from ...training.checkpoint import checkpoint_info, load_checkpoint, save_checkpoint
from .loaders import PositionedLoader
from .weights import gather_full, write_hf_folder


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _folder(accelerator, output_dir, saving: bool) -> Path:
    if output_dir is not None:
        return Path(output_dir)
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        api = "save_state(output_dir)" if saving else "load_state(input_dir)"
        raise ConfigError(f"accelerator.{api}: give a folder (or ProjectConfiguration(automatic_checkpoint_naming=True))")
    if config.total_limit is not None:
        raise ConfigError("ProjectConfiguration(total_limit=...) is not supported under Megatron-LM; "
                          "remove old checkpoint folders yourself")
    root = Path(accelerator.project_dir) / "checkpoints"
    if saving:
        return root / f"checkpoint_{accelerator.save_iteration}"
    done = sorted(root.glob("checkpoint_*"), key=lambda p: int(p.name.split("_")[-1]))
    if not done:
        raise ConfigError(f"accelerator.load_state(): no checkpoint_* folder in {root}")
    return done[-1]


def save_state(accelerator, engine, output_dir=None) -> str:
    if accelerator._custom_objects:
        raise ConfigError("accelerator.register_for_checkpointing objects are not saved under Megatron-LM; "
                          "keep their state in your own file")
    folder = _folder(accelerator, output_dir, saving=True)
    chunks = list(engine.chunks)
    extra = {"consumed_train_samples": engine.consumed_train_samples, "accelerate_step": accelerator.step,
             "dataloaders": [dl.position() if isinstance(dl, PositionedLoader) else {}
                             for dl in accelerator._dataloaders]}
    if engine.user_scheduler is not None:
        extra["user_scheduler"] = engine.user_scheduler.state_dict()
    save_checkpoint(folder, engine.iteration, chunks, engine.optimizer, engine.scheduler, extra=extra)
    full = gather_full(chunks, dst=accelerator.num_processes - 1)  # the main process: the last rank
    if full is not None:
        write_hf_folder(full, chunks[0].config, folder)
    _barrier()
    if output_dir is None:
        accelerator.project_configuration.iteration += 1
    return os.fspath(folder)


def load_state(accelerator, engine, input_dir=None) -> None:
    folder = _folder(accelerator, input_dir, saving=False)
    chunks = list(engine.chunks)
    _barrier()
    engine.iteration = load_checkpoint(folder, chunks, engine.optimizer, engine.scheduler)
    info = checkpoint_info(folder)
    engine.consumed_train_samples = int(info.get("consumed_train_samples") or 0)
    engine._accumulated = 0
    accelerator.step = int(info.get("accelerate_step") or 0)
    if engine.user_scheduler is not None and info.get("user_scheduler") is not None:
        engine.user_scheduler.load_state_dict(info["user_scheduler"])
    for loader, saved in zip(accelerator._dataloaders, info.get("dataloaders") or []):
        if isinstance(loader, PositionedLoader) and saved:
            loader.restore(saved)
    _barrier()
