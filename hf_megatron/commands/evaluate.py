"""`hf-megatron evaluate`: loss and perplexity of a checkpoint on one split of a dataset.

    hf-megatron evaluate --load ckpt --data-path corpus_text_document --split 969,30,1 --eval-iters 10
    torchrun --nproc-per-node 4 -m hf_megatron.cli evaluate --load ckpt --data-path corpus_text_document \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    hf-megatron evaluate --hf-model gpt2 --data-path heldout_text_document --split 0,1,0

`--load` takes a Megatron checkpoint saved in any tp / pp layout (its weights are read whole and
cut for this run's layout); `--hf-model` an HF folder or Hub id.  The samples are the ones the
training run's validation scores: the split's GPT dataset (same --split, --seq-length, --seed),
the first --eval-iters global batches (default: all full global batches of one epoch).  With the
same --global-batch-size and --eval-iters as training, the result equals that run's
`lm loss validation` at the same weights (as long as training's validation stayed within one epoch
of the split: more epochs are shuffled differently).

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


def _model(ecfg: EvalConfig, cfg, device):
    """(this rank's chunks, the checkpoint's recorded training seq_length or None)."""
    from ..training import trainer
    if ecfg.hf_model:
        return trainer.build_model(ecfg.hf_model, cfg, device=device), None
    from ..checkpoint.load import load_megatron_weights, open_megatron
    from ..training.checkpoint import checkpoint_info
    config = open_megatron(ecfg.load).config  # a bad folder fails here, before anything is built
    chunks = trainer.build_model(config, cfg, device=device, init=False)
    for chunk in chunks:
        load_megatron_weights(chunk, ecfg.load)
    return chunks, (checkpoint_info(ecfg.load).get("args") or {}).get("seq_length")


def evaluate(ecfg: EvalConfig) -> dict:
    """Collective under torchrun; every rank returns the same result."""
    from ..data.builder import build_gpt_datasets
    from ..errors import DataError
    from ..parallel import state
    from ..training import trainer
    from ..training.monitor import logging_rank, ppl
    from ..training.pretrain import _evaluate, init_distributed

    cfg = ecfg.training_config()
    device = init_distributed()
    trainer.setup_parallel(cfg)
    grid = state.get_state()
    chunks, trained_seq = _model(ecfg, cfg, device)
    positions = chunks[0].config.max_position_embeddings
    seq_length = ecfg.seq_length or trained_seq or min(1024, positions)
    gbs = cfg.micro_batch_size * grid.dp * cfg.num_micro_batches(grid.dp)
    which = EVAL_SPLITS.index(ecfg.eval_split)
    wanted = [None, None, None]
    wanted[which] = ecfg.eval_iters * gbs if ecfg.eval_iters else None
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
              "tp": grid.tp, "pp": grid.pp, "dp": grid.dp}
    if grid.rank == logging_rank(grid.world, grid.pp):
        print(f" {ecfg.eval_split} loss of {ecfg.load or ecfg.hf_model} on {data} | {batches} global batches of {gbs} "
              f"x {seq_length} tokens | lm loss value: {loss:.6E} | lm loss PPL: {ppl(loss):.6E} | "
              f"tp={grid.tp} pp={grid.pp} dp={grid.dp}", flush=True)
        print(json.dumps(result), flush=True)
    return result


def run(args) -> int:
    (ecfg,) = configs_from_args(args, EvalConfig)
    result = evaluate(ecfg)
    return 0 if math.isfinite(result["lm_loss"]) else 1

