"""The training loop behind `hf-megatron train` (Megatron-LM's `pretrain`, small).

    checks without a model (start.py: --load rules; preflight.py: data, splits, positions, batch)
    model (HF weights, a Megatron checkpoint's, or a fresh init)  ->  this rank's chunks (restore.py)
    loop: global batch -> train_step -> NaN check -> log (stdout, tensorboard) -> eval -> save -> exit?

Runs in one process or under torchrun (NCCL on GPUs, gloo on CPUs).  Resume: `--load DIR`
restores model, optimizer, scheduler and RNG, and the data continues after the consumed samples
(the validations too: each scores the next --eval-iters global batches of the valid split).
Stops (signals.py): --exit-signal-handler, --exit-interval, --exit-duration-in-mins save and
return normally.  A NaN/inf step in fp32/bf16 raises NonFiniteError before anything is saved.
One run per --save folder (lock.py).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.files import write_text_atomic
from ..errors import ConfigError, DataError, HFMegatronError
from ..parallel import state
from ..parallel.compile import compile_scope
from . import tokenizer_files, trainer
from .config import RunConfig  # noqa: F401  (re-exported: code imports it from here)


def init_distributed(backend: str | None = None) -> torch.device:
    """Process group from torchrun's environment (if any); this rank's device.  `backend`
    (--distributed-backend): nccl runs on the GPUs, gloo on the CPUs; default: nccl where CUDA is."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("RunConfig.distributed_backend (--distributed-backend nccl): expected CUDA GPUs, none is "
                          "available; use --distributed-backend gloo")
    if torch.cuda.is_available() and backend != "gloo":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def _global_batches(dataset, cfg: trainer.TrainingConfig, consumed: int, device):
    """This dp rank's micro batches of each global batch, on `device`: each sample's seq_length + 1
    tokens as seq_length inputs and seq_length aligned targets (data/loader.py).  The DataLoader
    iterator is created here, at the call (it draws its base seed from torch's global generator,
    which dropout uses too: a resume restores the RNG after this call)."""
    from ..data.loader import batch_iterator
    grid = state.get_state()
    iterator = batch_iterator(dataset, cfg.micro_batch_size, grid.rank_in("dp"), grid.dp, consumed)
    return _grouped(iterator, cfg.num_micro_batches(grid.dp), device)


def _grouped(iterator, num_micro: int, device):
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


class NonFiniteError(HFMegatronError, FloatingPointError):
    """A NaN or inf in the loss or the gradients with --check-for-nan-in-loss-and-grad (the default for
    fp32 and bf16): training stops before anything is saved, so the latest checkpoint stays the last good one."""


def _non_finite(stats: dict, cfg: trainer.TrainingConfig) -> bool:
    """A skipped step in fp32/bf16 (no loss scale to blame): a NaN or inf in some gradient, which a
    non-finite loss always leads to.  The optimizer's inf check is all-reduced, so every rank (every
    pipeline stage, too, where only the last one sees the loss) decides alike.  With a constant
    --loss-scale in bf16 / under the distributed optimizer (megatron-core's ConstantGradScaler) a
    skipped step with a finite loss is that scale's overflow, counted as skipped, not as NaN."""
    if cfg.fp16:
        return False
    if cfg.loss_scale is not None and (cfg.bf16 or cfg.use_distributed_optimizer):
        return stats["skipped"] and not math.isfinite(stats["loss"])
    return stats["skipped"]


def _setup(cfg: trainer.TrainingConfig, run: RunConfig):
    """Everything that can fail without a model, then the model: (cfg, start, source, device, gbs)."""
    from .preflight import (check_data, check_model_fits, check_null_tokenizer_fits, check_output_folders,
                            check_pipeline_split, check_save_format)
    from .start import model_source, plan_start
    check_output_folders(run)
    check_save_format(cfg, run)
    if cfg.sequence_parallel and run.seq_length % cfg.tensor_model_parallel_size:
        raise ConfigError(f"--seq-length {run.seq_length}: expected a multiple of --tensor-model-parallel-size "
                          f"{cfg.tensor_model_parallel_size} with --sequence-parallel")
    from ..checkpoint.checksums import set_checksums
    set_checksums(False if run.no_checkpoint_checksums else None)
    start = plan_start(run)
    check_data(run)
    source, model_config = model_source(run, start)
    check_model_fits(run.seq_length, model_config)
    check_null_tokenizer_fits(run, model_config)
    check_pipeline_split(cfg, model_config)
    device = init_distributed(run.distributed_backend)
    trainer.setup_parallel(cfg)
    grid = state.get_state()
    gbs = cfg.micro_batch_size * grid.dp * cfg.num_micro_batches(grid.dp)  # divisibility checked here
    return cfg.for_global_batch(gbs), start, source, device, gbs


def pretrain(cfg: trainer.TrainingConfig, run: RunConfig) -> dict[str, Any]:
    from .lock import SaveLock
    from .monitor import Monitor
    from .sampling import sampler_for_run
    from .signals import ExitConditions
    # Megatron-LM's validate_args: sequence parallelism needs tensor parallelism, else it is turned off
    sp_alone = cfg.sequence_parallel and cfg.tensor_model_parallel_size == 1
    if sp_alone:
        cfg = dataclasses.replace(cfg, sequence_parallel=False)
    monitor = Monitor(cfg, run)  # the banner, before anything slow
    for line in run.startup_warnings():
        monitor.warn(line)
    if cfg.loss_scale is not None and not (cfg.fp16 or cfg.bf16 or cfg.use_distributed_optimizer):
        monitor.warn(f"--loss-scale {cfg.loss_scale:g}: not applied in fp32 without --use-distributed-optimizer "
                     "(megatron-core's FP32Optimizer has no loss scaler)")
    if sp_alone:
        monitor.warn("--sequence-parallel: turned off, as Megatron-LM does, since tensor parallelism is off "
                     "(--tensor-model-parallel-size 1)")
    sampler = sampler_for_run(run, cfg.seed)  # a bad --tokenizer-model fails here, early
    exits = ExitConditions(run.exit_interval, run.exit_duration_in_mins, run.exit_signal_handler)
    lock = None
    try:  # the signal handlers are in place from here: a SIGTERM during setup stops after the first step
        cfg, start, source, device, gbs = _setup(cfg, run)
        monitor.cfg = cfg  # with the iterations a --train-samples run resolved to
        lock = SaveLock(run.save).acquire() if run.save else None
        if lock and lock.cleared:
            monitor.warn(f"--save {run.save}: removed what an interrupted save left there: {', '.join(lock.cleared)}")
        return _train(cfg, run, start, source, device, gbs, exits, monitor, sampler)
    finally:
        exits.restore()
        if lock:
            lock.release(remove_if_unused=True)  # a run that wrote nothing leaves no <save> folder behind


def _train(cfg, run, start, source, device, gbs, exits, monitor, sampler) -> dict[str, Any]:
    from ..checkpoint.files import TRACKER
    from ..data.builder import build_datasets
    from .checkpoint import restore_rng, save_checkpoint
    from .deferred import DeferredSteps
    from .preflight import used_splits
    from .restore import build_training_state

    grid = state.get_state()
    if start.kind == "resume" and (saved := start.iteration_to_load()) != "release" and saved >= cfg.train_iters:
        # said before the model is built, and nothing is written
        monitor.note(f" {start.megatron_dir} is at iteration {saved}, which already reaches --train-iters "
                     f"{cfg.train_iters}: nothing to train (raise --train-iters to continue)")
        return {"iterations": saved, "already_done": True, "final_loss": None, "first_loss": None}
    chunks, optimizer, scheduler, restored = build_training_state(run, cfg, start, source, device, gbs)
    monitor.model_built(chunks, optimizer)
    tokenizer = tokenizer_files.tokenizer_source(run)  # travels into <save>/tokenizer with the checkpoints
    tokenizer_files.check_vocab(tokenizer, chunks[0].config.vocab_size)
    iteration, consumed = restored.iteration, restored.consumed_samples
    monitor.note(f" {restored.source}")
    consumed_valid = restored_valid_samples(start, iteration, run, gbs)
    eval_samples = 0
    if run.validates():  # Megatron-LM's count; a resume with another global batch may need more
        per_validation = run.eval_iters * gbs
        eval_samples = max((cfg.train_iters // run.eval_interval + 1) * per_validation, consumed_valid
                           + (cfg.train_iters // run.eval_interval - iteration // run.eval_interval) * per_validation)
    train_ds, valid_ds, _ = build_datasets(
        run, cfg.seed,
        (max(cfg.train_iters * gbs, consumed + (cfg.train_iters - iteration) * gbs), eval_samples or None, None),
        vocab_size=chunks[0].config.vocab_size,
        skip_splits=[name for name in ("valid", "test") if name not in used_splits(run)])
    if train_ds is None:
        raise DataError(f"--split {run.split!r} gives the training split no documents")
    batches = _global_batches(train_ds, cfg, consumed, device)  # draws from the global RNG: restore after it
    restore_rng(restored.rng_state)

    sampler, why_not = sampler
    if why_not:
        monitor.note(why_not)
    monitor.start(iteration, gbs)

    runner = DeferredSteps(chunks, optimizer, scheduler) if cfg.defer_step_stats else None

    def planned_stop(at: int) -> bool:
        """An evaluation, a save or --exit-interval is due after iteration `at`."""
        return any(interval and at % interval == 0 for interval in (
            run.eval_interval if valid_ds is not None else None, run.save_interval if run.save else None,
            exits.exit_interval))

    def steps():
        """Each step's stats in order.  With --defer-step-stats (training/deferred.py) the next batch's
        forward and backward are queued before a step is read, except after a step that an
        evaluation, a save or --exit-interval follows: that one is finished alone, so the evaluation
        (whose data draws from the RNG) comes before the next step's dropout, as without the flag."""
        queued = 0
        while iteration + queued < cfg.train_iters:
            micro = next(batches, None)
            if micro is None:
                break
            if runner is None:
                yield trainer.train_step(chunks, optimizer, scheduler, micro)
                continue
            stats, queued = runner.step(micro), 1
            if stats is not None:
                yield stats
            if planned_stop(iteration + 1):  # the step just queued
                stats, queued = runner.finish(), 0
                yield stats
        if runner is not None and (stats := runner.finish()) is not None:
            yield stats

    def save(at: int, loss) -> None:
        # the data position also in `args`, where Megatron-LM reads it when it resumes our checkpoint
        # (and the run's data fields: `hf-megatron evaluate` rebuilds this run's validation data from them)
        args = {"seq_length": run.seq_length, "consumed_train_samples": consumed, "global_batch_size": gbs,
                "micro_batch_size": cfg.micro_batch_size, "split": run.split, "seed": cfg.seed,
                "train_iters": cfg.train_iters, "eval_interval": run.eval_interval, "eval_iters": run.eval_iters,
                "sft": run.sft, "sft_pack": run.sft_pack,
                "tokenizer": tokenizer_files.tokenizer_entry(tokenizer, run.save)}
        if not dist.is_initialized() or dist.get_rank() == 0:
            tokenizer_files.copy_into_save(tokenizer, run.save)
        save_checkpoint(run.save, at, chunks, optimizer, scheduler, args=args,
                        extra={"consumed_train_samples": consumed, "consumed_valid_samples": consumed_valid,
                               "loss": loss, "train_tokens": consumed * run.seq_length},
                        rng_state=runner.rng_state() if runner is not None else None, ckpt_format=run.ckpt_format,
                        save_optim=not run.no_save_optim, save_rng=not run.no_save_rng)

    counters = {"skipped_iterations": 0, "nan_iterations": 0}
    history, saved_at, exit_reason, unscored_steps = [], None, None, 0
    for stats in steps():
        iteration += 1
        consumed += gbs
        non_finite = _non_finite(stats, cfg)
        counters["skipped_iterations"] += int(stats["skipped"])
        counters["nan_iterations"] += int(non_finite)
        stats.update(counters, iteration=iteration, consumed_samples=consumed)
        if non_finite and not run.no_check_for_nan_in_loss_and_grad:
            tracker = Path(run.save or "", TRACKER)
            kept = f"latest checkpoint: iteration {tracker.read_text().strip()}" if run.save and tracker.is_file() \
                else "no checkpoint saved"
            what = f"the loss is {stats['loss']}" if not math.isfinite(stats["loss"]) else \
                f"the gradients are not finite (loss {stats['loss']:.4g})"
            raise NonFiniteError(f"iteration {iteration}: {what}; stopped by --check-for-nan-in-loss-and-grad, "
                                 f"nothing saved after it ({kept})")
        loss = stats["loss"]
        if stats["num_tokens"] == 0:  # loss 0 and zero gradients: the update is weight decay alone
            if not unscored_steps:
                monitor.warn(f"iteration {iteration}: no scored tokens in this global batch: the step applies only "
                             "weight decay (its lm loss is left out of the log)")
            unscored_steps += 1
            loss = None  # not a measured 0 (the monitor leaves it out of the logged average too)
        history.append(loss)
        monitor.step(iteration, stats)
        if run.eval_interval and valid_ds is not None and iteration % run.eval_interval == 0:
            # one valid iterator for the run, as Megatron-LM's: each validation scores the next eval_iters batches
            monitor.validation(iteration, _evaluate(chunks, valid_ds, cfg, run, device, consumed_valid))
            consumed_valid += run.eval_iters * gbs
            if sampler is not None:
                monitor.sample(iteration, sampler.prompt, sampler(chunks, iteration))
        if run.save and run.save_interval and iteration % run.save_interval == 0:
            with monitor.saving(iteration):
                save(iteration, loss)
            saved_at = iteration
        exit_reason = exits.reason(iteration)
        if exit_reason:
            break
    if unscored_steps and unscored_steps == iteration - restored.iteration:
        monitor.warn(f"no step of this run had a scored token ({unscored_steps} steps): nothing was learned from "
                     f"--data-path {' '.join(run.data_path)}{_why_unscored(run)}")
    summary = {"iterations": iteration, "final_loss": history[-1] if history else None,
               "first_loss": history[0] if history else None,
               "tokens": consumed * run.seq_length, "consumed_samples": consumed, **counters,
               "exit_reason": exit_reason, "tp": grid.tp, "pp": grid.pp, "dp": grid.dp,
               "torch_compile": compile_scope(chunks[0])}  # the compile scope, or None (eager)
    if run.save and saved_at != iteration and iteration > restored.iteration:  # never a copy of what was loaded
        with monitor.saving(iteration):
            save(iteration, history[-1] if history else None)
    if exit_reason:
        monitor.note(f" exiting at iteration {iteration}: {exit_reason}" + (f" (saved to {run.save})" if run.save else ""))
    if run.save and _is_logger():
        write_text_atomic(Path(run.save, "training_summary.json"), json.dumps(summary, indent=2))
    monitor.finish()
    return summary


def _evaluate(chunks, dataset, cfg, run, device, consumed: int = 0) -> float:
    """Megatron-LM's evaluate: the run.eval_iters global batches from sample `consumed` of `dataset`,

        loss = (sum of per-token losses over all of them) / (their scored tokens)

    -- a token-weighted mean, so SFT batches with few (or no) response tokens weigh what they hold.
    No scored token at all is a one-line DataError (Megatron-LM's 0/0 would be NaN)."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for i, micro in enumerate(_global_batches(dataset, cfg, consumed, device)):
        if i == run.eval_iters:
            break
        totals += trainer.evaluate_totals(chunks, micro)
    loss_sum, tokens = totals.tolist()
    if tokens == 0:
        raise DataError(f"--data-path {' '.join(run.data_path)}: no window of the {run.eval_iters} evaluated global "
                        f"batches has a scored token{_why_unscored(run)}")
    return loss_sum / tokens


def restored_valid_samples(start, iteration: int, run, gbs: int) -> int:
    """Megatron-LM's consumed_valid_samples when a run resumes: what the checkpoint recorded, else (a
    checkpoint without it) one validation of eval_iters global batches per eval_interval iterations."""
    if start.kind != "resume" or not iteration or not run.validates():
        return 0
    from .checkpoint import checkpoint_info
    saved = (checkpoint_info(start.megatron_dir, iteration).get("args") or {}).get("consumed_valid_samples")
    return int(saved) if saved else iteration // run.eval_interval * run.eval_iters * gbs


def _why_unscored(run) -> str:
    """Why an SFT window scores nothing: its response lies past the window."""
    return (f" (--sft scores response tokens only: --seq-length {run.seq_length} truncates the responses away; "
            "raise it)") if run.sft else ""
