"""`hf-megatron evaluate`: loss and perplexity of a checkpoint on one split of a dataset.

    hf-megatron evaluate --load ckpt --data-path corpus_text_document --split 969,30,1 --eval-iters 10
    torchrun --nproc-per-node 4 -m hf_megatron.cli evaluate --load ckpt --data-path corpus_text_document \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    hf-megatron evaluate --hf-model gpt2 --data-path heldout_text_document --split 0,1,0

`--load` takes a Megatron checkpoint saved in any tp / pp layout (its weights are read whole and
cut for this run's layout); `--hf-model` an HF folder or Hub id.  The samples are the ones the
training run's validation scores: the split's GPT dataset, built as that run built it, and its
first --eval-iters global batches.  A checkpoint written by `hf-megatron train` records
--split, --seed, --seq-length, --global-batch-size, --train-iters, --eval-interval and
--eval-iters (Megatron-LM's arg names); unset flags take those values, so

    hf-megatron evaluate --load ckpt --data-path corpus_text_document

reproduces the run's `lm loss validation` at the checkpoint's weights.  Without recorded values:
--split 969,30,1, seed 1234, every full global batch of one epoch of the split.

    loss = mean over global batches of (sum of per-token losses / scored tokens);  ppl = exp(loss)
"""
from __future__ import annotations

import argparse
import json
import math
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


def validation_samples(ecfg: EvalConfig, recorded: dict, gbs: int) -> int | None:
    """Samples to build the split with: for the valid split of a run that evaluated, what that run
    asked for (Megatron-LM's count: (train_iters // eval_interval + 1) * eval_iters * global batch),
    so the split is shuffled as it was; else this evaluation's need (None = one epoch)."""
    need = ecfg.eval_iters * gbs if ecfg.eval_iters else None
    keys = ("train_iters", "eval_interval", "eval_iters", "global_batch_size")
    if ecfg.eval_split != "valid" or not all(recorded.get(k) for k in keys):
        return need
    asked = (recorded["train_iters"] // recorded["eval_interval"] + 1) * recorded["eval_iters"] * recorded["global_batch_size"]
    return max(asked, need or 0)


def _model(ecfg: EvalConfig, cfg, device) -> list:
    from ..training import trainer
    if ecfg.hf_model:
        return trainer.build_model(ecfg.hf_model, cfg, device=device)
    from ..checkpoint.load import load_megatron_weights, open_megatron
    chunks = trainer.build_model(open_megatron(ecfg.load).config, cfg, device=device, init=False)
    for chunk in chunks:
        load_megatron_weights(chunk, ecfg.load)
    return chunks


def evaluate(ecfg: EvalConfig) -> dict:
    """Collective under torchrun; every rank returns the same result."""
    from ..data.builder import build_gpt_datasets
    from ..errors import DataError
    from ..parallel import state
    from ..training import trainer
    from ..training.monitor import logging_rank, ppl
    from ..training.pretrain import _evaluate, init_distributed

    recorded = recorded_args(ecfg.load)
    ecfg = ecfg.with_recorded(recorded)
    cfg = ecfg.training_config()
    device = init_distributed()
    trainer.setup_parallel(cfg)
    grid = state.get_state()
    chunks = _model(ecfg, cfg, device)
    seq_length = ecfg.seq_length or min(1024, chunks[0].config.max_position_embeddings)
    gbs = cfg.micro_batch_size * grid.dp * cfg.num_micro_batches(grid.dp)
    which = EVAL_SPLITS.index(ecfg.eval_split)
    wanted = [None, None, None]
    wanted[which] = validation_samples(ecfg, recorded, gbs)
    data = ecfg.data_path if len(ecfg.data_path) > 1 else ecfg.data_path[0]
    dataset = build_gpt_datasets(data, split=ecfg.split, seq_length=seq_length, seed=cfg.seed,
                                 num_samples=tuple(wanted), cache_dir=ecfg.data_cache_path or "auto")[which]
    batches = len(dataset) // gbs if ecfg.eval_iters is None else min(ecfg.eval_iters, len(dataset) // gbs)
    if batches == 0:
        raise DataError(f"--data-path {data}: the {ecfg.eval_split} split of --split {ecfg.split!r} has {len(dataset)} "
                        f"samples of {seq_length} tokens, fewer than one global batch of {gbs}")
    loss = _evaluate(chunks, dataset, cfg, types.SimpleNamespace(eval_iters=batches), device)
    result = {"split": ecfg.eval_split, "lm_loss": loss, "ppl": ppl(loss), "global_batches": batches,
              "samples": batches * gbs, "tokens": batches * gbs * seq_length, "seq_length": seq_length,
              "data_split": ecfg.split, "seed": cfg.seed, "tp": grid.tp, "pp": grid.pp, "dp": grid.dp}
    if grid.rank == logging_rank(grid.world, grid.pp):
        print(f" {ecfg.eval_split} loss of {ecfg.load or ecfg.hf_model} on {data} (--split {ecfg.split}, seed "
              f"{cfg.seed}) | {batches} global batches of {gbs} x {seq_length} tokens | lm loss value: {loss:.6E} | "
              f"lm loss PPL: {ppl(loss):.6E} | tp={grid.tp} pp={grid.pp} dp={grid.dp}", flush=True)
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

