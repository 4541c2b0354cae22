"""`hf-megatron reshard`: re-split a Megatron checkpoint to another TP / PP layout, without HF.

    hf-megatron reshard --src ckpt_tp2_pp2/ --out ckpt_tp4/ --tp 4 --pp 1 --verify
    hf-megatron reshard --src run/ --out run_tp1_pp2/ --tp 1 --pp 2 --with-optimizer
    hf-megatron reshard --src run/ --out run_tp2/ --tp 2 --with-optimizer --use-distributed-optimizer \
        --overlap-grad-reduce --ddp-bucket-size 40000000

Megatron-LM's tools/checkpoint/convert.py spellings work too: --load-dir, --save-dir,
--target-tensor-parallel-size, --target-pipeline-parallel-size.

Model weights only by default: the optimizer and RNG restart (resume with --no-load-optim --no-load-rng,
or fine-tune).
The iteration number and tokenizer files are kept.

--with-optimizer also carries a training checkpoint's optimizer state: fp32 main weights and
Adam moments split exactly like their weights (vocab padding, QKV / gate-up interleaving, tied
embeddings on the last stage), the step, param groups and loss scaler, the LR scheduler, the
data position (consumed samples) and the run's args; `hf-megatron train --load OUT` at the new
tp/pp (any dp, with or without --use-distributed-optimizer) and Megatron-LM then continue with
the losses the unresharded run has.  Each rank folder gets what `train --save` writes for the
target's optimizer: with --use-distributed-optimizer (the default when the source ran with it)
megatron-core's DistributedOptimizer files -- distrib_optim.pt laid out by the target's grad
buffers, whose flags (--overlap-grad-reduce, --ddp-bucket-size; default: the source's) are
recorded in args and must be the ones Megatron-LM resumes with -- and otherwise
(--no-use-distributed-optimizer) Megatron-LM's FP32Optimizer / Float16OptimizerWithFloat16Params
entry in model_optim_rng.pt.  RNG: a rank (t, p) that exists in both layouts keeps its
streams; default streams of a new pipeline stage and the tensor-parallel stream of a new tp
rank are seeded as a fresh run at the new layout seeds them (seed from the checkpoint's args).
"""
from __future__ import annotations

import argparse
import functools

from ..errors import ConfigError
from .convert import add_checksum_flag, add_output_format_flags

TARGET_FLAGS = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("reshard", help="change the TP/PP layout of a Megatron checkpoint",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", "--load-dir", required=True, help="Megatron checkpoint root or iter_* folder")
    parser.add_argument("--out", "--save-dir", required=True, help="new checkpoint folder")
    parser.add_argument("--tp", "--target-tensor-parallel-size", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", "--target-pipeline-parallel-size", type=int, default=1,
                        help="pipeline-parallel size")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per stage")
    parser.add_argument("--verify", action="store_true", help="compare logits of source and result")
    parser.add_argument("--with-optimizer", action="store_true",
                        help="also carry optimizer state, LR scheduler, RNG and data position, so that training "
                             "resumes at the new layout (torch format only; RNG policy: see above)")
    target = parser.add_argument_group("the target's optimizer (with --with-optimizer; default: as the source ran)")
    target.add_argument("--use-distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
                        help="write megatron-core's DistributedOptimizer files (distrib_optim.pt + its optimizer "
                             "entry); --no-use-distributed-optimizer: Megatron-LM's FP32Optimizer / "
                             "Float16OptimizerWithFloat16Params entry in model_optim_rng.pt")
    target.add_argument("--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=None,
                        help="distributed target: the run resumes with --overlap-grad-reduce (distrib_optim.pt's "
                             "bucket layout follows it)")
    target.add_argument("--ddp-bucket-size", type=int, default=None, metavar="N",
                        help="distributed target: the run's --ddp-bucket-size (elements per bucket, with "
                             "--overlap-grad-reduce)")
    add_checksum_flag(parser)
    add_output_format_flags(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from hf_megatron.commands.convert import _print_report, apply_checksum_flag
    apply_checksum_flag(args)
    from hf_megatron.conversion.convert import reshard
    carrier = None
    target = {"distributed": args.use_distributed_optimizer, "overlap_grad_reduce": args.overlap_grad_reduce,
              "ddp_bucket_size": args.ddp_bucket_size}
    given = [flag for flag, value in zip(TARGET_FLAGS, target.values()) if value is not None]
    if given and not args.with_optimizer:
        raise ConfigError(f"{given[0]}: describes the target's optimizer; give --with-optimizer as well")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        raise ConfigError(f"--ddp-bucket-size: expected at least 1 element, got {args.ddp_bucket_size}")
    if target["distributed"] is False and (target["overlap_grad_reduce"] is not None or target["ddp_bucket_size"]):
        raise ConfigError("--overlap-grad-reduce / --ddp-bucket-size: describe a distributed optimizer's buckets; "
                          "leave them out with --no-use-distributed-optimizer")
    if args.with_optimizer:
        from hf_megatron.training.reshard_optimizer import ResumableReshard
        carrier = functools.partial(ResumableReshard, **target)
    _print_report(reshard(args.src, args.out, args.tp, args.pp, args.vpp, args.verify, args.ckpt_format,
                          args.legacy_names, training_state=carrier))
    return 0
