"""The training loop behind `hf-megatron train` (Megatron-LM's `pretrain`, small).

    data (.bin/.idx prefixes, blend, split)  ->  GPT datasets with cached indices
    model (HF weights, or a fresh init from an HF config)  ->  this rank's chunks
    loop: global batch -> train_step -> log (stdout, tensorboard) -> eval -> save

Runs in one process or under torchrun (NCCL on GPUs, gloo on CPUs).  Resume: `--load DIR`
restores model, optimizer, scheduler and RNG, and the data continues after the consumed samples.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError, DataError
from ..parallel import state
from . import trainer
from .config import RunConfig  # noqa: F401  (re-exported: code imports it from here)


def init_distributed() -> torch.device:
    """Process group from torchrun's environment (if any); this rank's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def _model_source(run: RunConfig):
    if run.hf_model:
        return run.hf_model  # RunConfig guarantees exactly one of hf_model / hf_config
    from transformers import AutoConfig

    from ..config import ModelConfig
    path = Path(run.hf_config)
    if not path.exists():
        raise ConfigError(f"--hf-config {path}: no such file or folder")
    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        reason = str(exc).partition("\n")[0]
        raise ConfigError(f"--hf-config {path}: not a transformers config.json ({reason})") from None
    return ModelConfig.from_hf(hf_config)


def _global_batches(dataset, cfg: trainer.TrainingConfig, consumed: int, device):
    """Yield this dp rank's micro batches of each global batch, on `device`: each sample's
    seq_length + 1 tokens as seq_length inputs and seq_length aligned targets (data/loader.py)."""
    from ..data.loader import batch_iterator
    grid = state.get_state()
    num_micro = cfg.num_micro_batches(grid.dp)
    iterator = batch_iterator(dataset, cfg.micro_batch_size, grid.rank_in("dp"), grid.dp, consumed)
    while True:
        micro = []
        for _ in range(num_micro):
            batch = next(iterator, None)
            if batch is None:
                return
            micro.append({k: v.to(device, non_blocking=True) for k, v in batch.items()})
        yield micro


def _is_logger() -> bool:
    """Last pipeline stage, tp rank 0, dp rank 0 prints (it has the loss first-hand)."""
    grid = state.get_state()
    return grid.coords["tp"] == 0 and grid.coords["dp"] == 0 and grid.coords["pp"] == grid.pp - 1


def pretrain(cfg: trainer.TrainingConfig, run: RunConfig) -> dict[str, Any]:
    from ..data.builder import build_gpt_datasets
    from .checkpoint import load_checkpoint, save_checkpoint
    from .monitor import Monitor
    from .sampling import sampler_for_run

    monitor = Monitor(cfg, run)  # the banner, before anything slow
    sampler, why_not = sampler_for_run(run, cfg.seed)  # a bad --tokenizer-model fails here, early
    if cfg.sequence_parallel and run.seq_length % cfg.tensor_model_parallel_size:
        raise ConfigError(f"--seq-length {run.seq_length}: expected a multiple of --tensor-model-parallel-size "
                          f"{cfg.tensor_model_parallel_size} with --sequence-parallel")
    device = init_distributed()
    trainer.setup_parallel(cfg)
    grid = state.get_state()
    chunks = trainer.build_model(_model_source(run), cfg, device=device)
    optimizer = trainer.build_optimizer(chunks, cfg)
    scheduler = trainer.build_scheduler(optimizer, cfg)
    monitor.model_built(chunks, optimizer)
    gbs = cfg.micro_batch_size * grid.dp * cfg.num_micro_batches(grid.dp)

    iteration = 0
    if run.load and (Path(run.load) / "latest_checkpointed_iteration.txt").is_file():
        iteration = load_checkpoint(run.load, chunks, optimizer, scheduler)
    eval_samples = 0
    if run.eval_interval:
        eval_samples = (cfg.train_iters // run.eval_interval + 1) * run.eval_iters * gbs
    train_ds, valid_ds, _ = build_gpt_datasets(
        run.data_path if len(run.data_path) > 1 else run.data_path[0], split=run.split,
        seq_length=run.seq_length, seed=cfg.seed, num_samples=(cfg.train_iters * gbs, eval_samples or None, None),
        cache_dir=run.data_cache_path or "auto")
    if train_ds is None:
        raise DataError(f"--split {run.split!r} gives the training split no documents")

    if why_not:
        monitor.note(why_not)
    monitor.start(iteration, gbs)

    def save(at: int, loss) -> None:
        # Megatron-LM's arg names; `hf-megatron evaluate` rebuilds this run's validation data from them
        recorded = {"seq_length": run.seq_length, "split": run.split, "seed": cfg.seed, "train_iters": cfg.train_iters,
                    "eval_interval": run.eval_interval, "eval_iters": run.eval_iters, "global_batch_size": gbs}
        save_checkpoint(run.save, at, chunks, optimizer, scheduler, args=recorded,
                        extra={"consumed_train_samples": at * gbs, "loss": loss,
                               "train_tokens": at * gbs * run.seq_length})

    batches = _global_batches(train_ds, cfg, iteration * gbs, device)
    history, last = [], {}
    while iteration < cfg.train_iters:
        micro = next(batches, None)
        if micro is None:
            break
        stats = trainer.train_step(chunks, optimizer, scheduler, micro)
        iteration += 1
        history.append(stats["loss"])
        last = stats
        monitor.step(iteration, stats)
        if run.eval_interval and valid_ds is not None and iteration % run.eval_interval == 0:
            monitor.validation(iteration, _evaluate(chunks, valid_ds, cfg, run, device))
            if sampler is not None:
                monitor.sample(iteration, sampler.prompt, sampler(chunks, iteration))
        if run.save and run.save_interval and iteration % run.save_interval == 0:
            with monitor.saving(iteration):
                save(iteration, stats["loss"])
    summary = {"iterations": iteration, "final_loss": last.get("loss"), "first_loss": history[0] if history else None,
               "tokens": iteration * gbs * run.seq_length, "tp": grid.tp, "pp": grid.pp, "dp": grid.dp}
    if run.save and (not run.save_interval or iteration % run.save_interval):
        with monitor.saving(iteration):
            save(iteration, last.get("loss"))
    if run.save and _is_logger():
        Path(run.save, "training_summary.json").write_text(json.dumps(summary, indent=2))
    monitor.finish()
    return summary


def _evaluate(chunks, dataset, cfg, run, device) -> float:
    losses = []
    for i, micro in enumerate(_global_batches(dataset, cfg, 0, device)):
        if i == run.eval_iters:
            break
        losses.append(trainer.evaluate(chunks, micro))
    return sum(losses) / max(len(losses), 1)
