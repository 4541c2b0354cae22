"""`hf-megatron evaluate`: loss and perplexity of a checkpoint on one split of a dataset.

    hf-megatron evaluate --load ckpt --data-path corpus_text_document --split 969,30,1 --eval-iters 10
    torchrun --nproc-per-node 4 -m hf_megatron.cli evaluate --load ckpt --data-path corpus_text_document \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    hf-megatron evaluate --hf-model gpt2 --data-path heldout_text_document --split 0,1,0

`--load` takes a Megatron checkpoint saved in any tp / pp layout (its weights are read whole and
cut for this run's layout); `--hf-model` an HF folder or Hub id.  The samples are the ones the
training run's validation scores: the split's GPT dataset, built as that run built it, and the
--eval-iters global batches of the run's latest validation (validation k scores the k-th ones, as
Megatron-LM's one valid iterator; JSON `first_sample`), from the split's start when --split is given.
A checkpoint written by `hf-megatron train` records --split, --seed, --seq-length,
--global-batch-size, --train-iters, --eval-interval, --eval-iters and consumed_valid_samples
(Megatron-LM's arg names); unset flags take those values, so

    hf-megatron evaluate --load ckpt --data-path corpus_text_document

reproduces the run's `lm loss validation` at the checkpoint's weights (saved at a validation).  Without recorded values:
--split 969,30,1, seed 1234, every full global batch of one epoch of the split (also the count for a run
that never validated: no --eval-interval, or --eval-iters 0).  A weighted blend
(`--data-path 0.3 A 0.7 B`) is scored as Megatron-LM validates it: the blend of each prefix's split,
sized by the samples asked for (so --eval-iters, given or recorded, is needed).  A checkpoint
trained with --sft (recorded too) is scored as training scored it, response tokens only; --sft
does the same for an --hf-model.  --seq-length and the data's token ids are checked against the
model as `train` checks them, before the model is built.

    loss = (sum of per-token losses over all evaluated batches) / (their scored tokens);  ppl = exp(loss)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import types

from ..training.config import EVAL_SPLITS, EvalConfig
from .flags import add_flags, configs_from_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("evaluate", help="loss and perplexity of a checkpoint on a data split (torchrun: any layout)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, EvalConfig)
    p.set_defaults(func=run)


def recorded_args(load: str | None) -> dict:
    """What a training checkpoint recorded of its run (Megatron-LM arg names); {} for none."""
    if not load:
        return {}
    from ..checkpoint.load import open_megatron
    from ..training.checkpoint import checkpoint_info
    open_megatron(load)  # a folder that is not a checkpoint fails here with one line
    return checkpoint_info(load).get("args") or {}


def validation_start(ecfg: EvalConfig, recorded: dict) -> int:
    """The first sample to score (`ecfg` as given, before `with_recorded`): for the valid split of a
    run that validated, scored on that run's own --split, the first sample of its latest validation
    (Megatron-LM's consumed_valid_samples less one validation of eval_iters x global batch: validation
    k scores the k-th eval_iters global batches), so a checkpoint saved at a validation reproduces it;
    else 0, the split's start."""
    keys = ("eval_interval", "eval_iters", "global_batch_size")
    if ecfg.eval_split != "valid" or ecfg.split is not None or not all(recorded.get(k) for k in keys):
        return 0
    latest = int(recorded.get("consumed_valid_samples") or 0) - recorded["eval_iters"] * recorded["global_batch_size"]
    return max(latest, 0)


def validation_samples(ecfg: EvalConfig, recorded: dict, gbs: int, start: int = 0) -> int | None:
    """Samples to build the split with: for the valid split of a run that evaluated, what that run
    asked for (Megatron-LM's count: (train_iters // eval_interval + 1) * eval_iters * global batch),
    so the split is shuffled as it was; else this evaluation's need (None = one epoch)."""
    need = start + ecfg.eval_iters * gbs if ecfg.eval_iters else None
    keys = ("train_iters", "eval_interval", "eval_iters", "global_batch_size")
    if ecfg.eval_split != "valid" or not all(recorded.get(k) for k in keys):
        return need
    asked = (recorded["train_iters"] // recorded["eval_interval"] + 1) * recorded["eval_iters"] * recorded["global_batch_size"]
    return max(asked, need or 0)


def _model_config(ecfg: EvalConfig):
    """The model's ModelConfig, read without building it (checks come before the slow part)."""
    if ecfg.hf_model:
        from ..training.start import config_of_hf
        return config_of_hf(ecfg.hf_model)
    from ..checkpoint.load import open_megatron
    return open_megatron(ecfg.load).config


def _model(ecfg: EvalConfig, cfg, device) -> list:
    from ..training import trainer
    if ecfg.hf_model:
        return trainer.build_model(ecfg.hf_model, cfg, device=device)
    from ..checkpoint.load import load_megatron_weights, open_megatron
    chunks = trainer.build_model(open_megatron(ecfg.load).config, cfg, device=device, init=False)
    for chunk in chunks:
        load_megatron_weights(chunk, ecfg.load)
    return chunks


def _warn(line: str) -> None:
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"hf-megatron evaluate: warning: {line}", file=sys.stderr, flush=True)


def _check_sft_data(ecfg: EvalConfig) -> None:
    """Never score an SFT dataset as pretraining text without saying so."""
    from ..data.indexed import idx_path
    from ..data.sft_records import loss_mask_prefix
    if ecfg.sft or len(ecfg.data_path) != 1 or len(ecfg.data_path[0].split()) != 1:
        return
    if os.path.isfile(idx_path(loss_mask_prefix(ecfg.data_path[0]))):
        _warn(f"--data-path {ecfg.data_path[0]} is an SFT dataset (it has a loss mask) scored as pretraining text "
              "(every token, packed windows); give --sft to score response tokens only, as `train --sft` does")


def evaluate(ecfg: EvalConfig) -> dict:
    """Collective under torchrun; every rank returns the same result."""
    from ..data.builder import build_datasets, parse_data_path
    from ..errors import ConfigError, DataError
    from ..parallel import state
    from ..training.monitor import logging_rank, ppl
    from ..training.preflight import check_model_fits, check_output_folders, check_pipeline_split
    from ..training.pretrain import _evaluate, init_distributed

    check_output_folders(ecfg)
    recorded = recorded_args(ecfg.load)
    start = validation_start(ecfg, recorded)
    ecfg = ecfg.with_recorded(recorded)
    cfg = ecfg.training_config()
    model_config = _model_config(ecfg)
    seq_length = ecfg.seq_length or min(1024, model_config.max_position_embeddings)
    check_model_fits(seq_length, model_config)  # as train: one line, before the model is built
    check_pipeline_split(cfg, model_config)
    data = " ".join(ecfg.data_path)
    _, weights = parse_data_path(ecfg.data_path)
    device = init_distributed()
    from ..training import trainer
    trainer.setup_parallel(cfg)
    grid = state.get_state()
    gbs = cfg.micro_batch_size * grid.dp * cfg.num_micro_batches(grid.dp)
    which = EVAL_SPLITS.index(ecfg.eval_split)
    wanted = [None, None, None]
    wanted[which] = validation_samples(ecfg, recorded, gbs, start)
    if weights is not None and wanted[which] is None:
        # Megatron-LM samples a weighted blend by count (eval_iters x global batch per evaluation): no epoch
        raise ConfigError(f"EvalConfig.eval_iters (--eval-iters): expected a number of global batches to score "
                          f"with a weighted --data-path blend ({data}), which is sampled by "
                          "count, not by epochs")
    _check_sft_data(ecfg)
    run = types.SimpleNamespace(data_path=ecfg.data_path, split=ecfg.split, seq_length=seq_length,
                                data_cache_path=ecfg.data_cache_path, sft=ecfg.sft, sft_pack=ecfg.sft_pack)
    dataset = build_datasets(run, cfg.seed, tuple(wanted), vocab_size=model_config.vocab_size,
                             skip_splits=[name for name in EVAL_SPLITS if name != ecfg.eval_split])[which]
    full = (len(dataset) - start) // gbs
    batches = full if ecfg.eval_iters is None else min(ecfg.eval_iters, full)
    if batches <= 0:
        raise DataError(f"--data-path {data}: the {ecfg.eval_split} split of --split {ecfg.split!r} has {len(dataset)} "
                        f"samples of {seq_length} tokens, fewer than one global batch of {gbs}")
    chunks = _model(ecfg, cfg, device)
    loss = _evaluate(chunks, dataset, cfg, types.SimpleNamespace(**{**vars(run), "eval_iters": batches}), device,
                     start)
    result = {"split": ecfg.eval_split, "lm_loss": loss, "ppl": ppl(loss), "global_batches": batches,
              "first_sample": start,
              "samples": batches * gbs, "tokens": batches * gbs * seq_length, "seq_length": seq_length,
              "data_split": ecfg.split, "seed": cfg.seed, "sft": ecfg.sft, "tp": grid.tp, "pp": grid.pp,
              "dp": grid.dp}
    if grid.rank == logging_rank(grid.world, grid.pp):
        print(f" {ecfg.eval_split} loss of {ecfg.load or ecfg.hf_model} on {data} (--split {ecfg.split}, seed "
              f"{cfg.seed}{', --sft' if ecfg.sft else ''}) | {batches} global batches of {gbs} x {seq_length} tokens "
              f"{f'from sample {start} ' if start else ''}"
              f"| lm loss value: {loss:.6E} | lm loss PPL: {ppl(loss):.6E} | tp={grid.tp} pp={grid.pp} dp={grid.dp}",
              flush=True)
        print(json.dumps(result), flush=True)
    return result


def run(args) -> int:
    import torch.distributed as dist
    (ecfg,) = configs_from_args(args, EvalConfig)
    result = evaluate(ecfg)
    if dist.is_initialized():  # leave together: a rank exiting while gloo still talks to it aborts the other
        dist.barrier()
        dist.destroy_process_group()
    return 0 if math.isfinite(result["lm_loss"]) else 1

