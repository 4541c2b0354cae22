"""Build this rank's model, optimizer and LR schedule, and restore what the start plan says
(`start.py`): nothing (fresh), weights only (fine-tune), or the whole training state (resume).

Resume, as Megatron-LM: the iteration and the data position (`consumed_train_samples`, so a
changed global batch size continues at the right sample) come from the checkpoint; the optimizer
unless --no-load-optim (which, as in Megatron-LM, also starts the LR schedule afresh); the LR
schedule's step count, its shape checked against the flags (`checkpoint.restore_scheduler`); the
RNG streams unless --no-load-rng (a checkpoint without them is refused, as Megatron-LM does) --
handed back, not set: the caller sets them after creating the data iterator, which draws from the
global generator (a resumed run with dropout then draws what the uninterrupted run drew).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..config import ModelConfig
from ..errors import CheckpointError
from ..model.attention import CoreAttention
from . import trainer
from .checkpoint import load_checkpoint
from .config import RunConfig
from .start import Start


@dataclass
class Restored:
    iteration: int = 0
    consumed_samples: int = 0
    rng_state: Any = None  # set it once the data iterator exists (`checkpoint.restore_rng`)
    source: str = "fresh"  # what the log says the weights came from


def set_dropout(chunks, hidden: float | None, attention: float | None) -> None:
    """--hidden-dropout (embeddings and both residual branches, as Megatron-LM) and --attention-dropout
    on built chunks, in their modules and in their config (so the checkpoint's args record them)."""
    for chunk in chunks:
        if hidden is not None:
            chunk.config.hidden_dropout = chunk.config.embedding_dropout = hidden
        if attention is not None:
            chunk.config.attention_dropout = attention
        for name, module in chunk.named_modules():
            if hidden is not None and isinstance(module, nn.Dropout) and name.endswith(("hidden_dropout",
                                                                                          "embedding_dropout")):
                module.p = hidden
            if attention is not None and isinstance(module, CoreAttention):
                module.dropout = attention


def _scheduler_policy(run: RunConfig) -> str:
    if run.override_opt_param_scheduler:
        return "override"
    return "checkpoint" if run.use_checkpoint_opt_param_scheduler else "check"


def build_training_state(run: RunConfig, cfg: trainer.TrainingConfig, start: Start, source, device,
                         global_batch_size: int):
    """(model chunks, optimizer, scheduler, Restored) for this rank."""
    from ..checkpoint.load import load_megatron_weights
    kwargs = {"init": start.kind == "fresh"} if isinstance(source, ModelConfig) else {}
    chunks = trainer.build_model(source, cfg, device=device, **kwargs)
    set_dropout(chunks, run.hidden_dropout, run.attention_dropout)
    optimizer = trainer.build_optimizer(chunks, cfg)
    scheduler = trainer.build_scheduler(optimizer, cfg)
    restored = Restored(source=f"starting from {source} (pretrained weights)" if not isinstance(source, ModelConfig)
                        else "starting from a Megatron-style init")
    if start.kind == "finetune":
        if start.megatron_dir is not None:
            for chunk in chunks:  # any saved layout: full tensors, cut for this rank
                load_megatron_weights(chunk, start.megatron_dir, start.iteration)
        optimizer.reload_model_params()  # its fp32 main weights were copied from the model before the load
        restored.source = f"fine-tuning from {start.megatron_dir or start.hf_source} (weights only, iteration 0)"
    elif start.kind == "resume":
        info: dict[str, Any] = {}
        load_optim = not run.no_load_optim
        restored.iteration = load_checkpoint(start.megatron_dir, chunks, optimizer if load_optim else None,
                                             scheduler if load_optim else None, iteration=start.iteration,
                                             load_rng=False,
                                             scheduler_policy=_scheduler_policy(run), info=info)
        if not load_optim:  # Megatron-LM's load_checkpoint: optimizer.reload_model_params()
            optimizer.reload_model_params()
        args = info.get("args")
        saved = info.get("consumed_train_samples")
        if saved is None and isinstance(args, argparse.Namespace):  # Megatron-LM keeps it in args
            saved = getattr(args, "consumed_train_samples", None)
        restored.consumed_samples = int(saved) if saved is not None else restored.iteration * global_batch_size
        restored.rng_state = None if run.no_load_rng else info.get("rng_state")
        if not run.no_load_rng and info.get("rng_state") is None:  # Megatron-LM's load_checkpoint exits there too
            raise CheckpointError(f"{info.get('path', start.megatron_dir)}: holds no RNG state (saved with "
                                  "--no-save-rng?); resume it with --no-load-rng (fresh RNG streams) or --finetune")
        restored.source = f"resuming from {start.megatron_dir} iteration {restored.iteration}"
    return chunks, optimizer, scheduler, restored
