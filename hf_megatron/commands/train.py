"""`hf-megatron train`: Megatron-style pretraining / fine-tuning from the command line.

    torchrun --nproc-per-node 8 -m hf_megatron.cli train --hf-model meta-llama/Llama-3.1-8B \\
        --data-path corpus_text_document --seq-length 4096 --micro-batch-size 1 --global-batch-size 256 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel --bf16 \\
        --lr 3e-5 --train-iters 1000 --save ckpt --save-interval 200

Fine-tuning (Megatron-LM's flags and rules; README "Fine-tuning"):

    hf-megatron train --pretrained-checkpoint base_ckpt --load ft --save ft --lr 1e-5 --train-iters 300 ...

`--load` must hold a checkpoint, except when it is this run's `--save` folder (a new run starts
fresh there, from --pretrained-checkpoint's weights when given): a typo never trains from scratch.
--exit-signal-handler, --exit-interval and --exit-duration-in-mins save and exit with status 0.

Flag names are Megatron-LM's; the flags are generated from the fields of RunConfig and
TrainingConfig (hf_megatron/training/config.py), which also check every value.
"""
from __future__ import annotations

import argparse

from ..errors import ConfigError
from ..training.config import RunConfig, TrainingConfig
from .flags import add_flags, add_megatron_lm_no_ops, configs_from_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a GPT model (run under torchrun for several processes)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, RunConfig, TrainingConfig)
    add_megatron_lm_no_ops(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..training.pretrain import pretrain
    if args.train_iters is None and args.train_samples is None:
        raise ConfigError("TrainingConfig.train_iters (--train-iters): expected --train-iters N or --train-samples N")
    run_config, cfg = configs_from_args(args, RunConfig, TrainingConfig)
    summary = pretrain(cfg, run_config)
    return 0 if summary["iterations"] else 1
