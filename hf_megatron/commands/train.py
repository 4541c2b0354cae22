"""`hf-megatron train`: Megatron-style pretraining / fine-tuning from the command line.

    torchrun --nproc-per-node 8 -m hf_megatron.cli train --hf-model meta-llama/Llama-3.1-8B \
        --data-path corpus_text_document --seq-length 4096 --micro-batch-size 1 --global-batch-size 256 \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel --bf16 \
        --lr 3e-5 --train-iters 1000 --save ckpt --save-interval 200

Flag names are Megatron-LM's.
"""
from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a GPT model (run under torchrun for several processes)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_argument_group("model")
    source = model.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-model", help="HF folder or Hub id: pretrained weights and config")
    source.add_argument("--hf-config", help="HF config.json (file or folder): fresh Megatron-style init")
    data = p.add_argument_group("data")
    data.add_argument("--data-path", nargs="+", required=True, help="prefix, or 'w1 prefix1 w2 prefix2 ...'")
    data.add_argument("--split", default="969,30,1")
    data.add_argument("--seq-length", type=int, default=1024)
    data.add_argument("--data-cache-path", default=None)
    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=int, default=1)
    t.add_argument("--global-batch-size", type=int, default=None)
    t.add_argument("--train-iters", type=int, required=True)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--min-lr", type=float, default=0.0)
    t.add_argument("--lr-warmup-iters", type=int, default=0)
    t.add_argument("--lr-decay-iters", type=int, default=None)
    t.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.999)
    t.add_argument("--adam-eps", type=float, default=1e-8)
    t.add_argument("--clip-grad", type=float, default=1.0)
    t.add_argument("--bf16", action="store_true")
    t.add_argument("--fp16", action="store_true")
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--use-distributed-optimizer", action="store_true")
    io = p.add_argument_group("checkpointing and logging")
    io.add_argument("--save", default=None)
    io.add_argument("--save-interval", type=int, default=None)
    io.add_argument("--load", default=None)
    io.add_argument("--log-interval", type=int, default=10)
    io.add_argument("--eval-interval", type=int, default=None)
    io.add_argument("--eval-iters", type=int, default=10)
    io.add_argument("--tensorboard-dir", default=None)
    p.set_defaults(func=run)


TRAINING_FIELDS = (
    "micro_batch_size", "global_batch_size", "train_iters", "lr", "min_lr", "lr_warmup_iters", "lr_decay_iters",
    "lr_decay_style", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "bf16", "fp16", "seed",
    "recompute_granularity", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "sequence_parallel", "use_distributed_optimizer",
)
RUN_FIELDS = ("data_path", "hf_model", "hf_config", "split", "seq_length", "data_cache_path", "save",
              "save_interval", "load", "log_interval", "eval_interval", "eval_iters", "tensorboard_dir")


def run(args) -> int:
    from ..training.pretrain import RunConfig, pretrain
    from ..training.trainer import TrainingConfig
    cfg = TrainingConfig(**{k: getattr(args, k) for k in TRAINING_FIELDS})
    summary = pretrain(cfg, RunConfig(**{k: getattr(args, k) for k in RUN_FIELDS}))
    return 0 if summary["iterations"] else 1
