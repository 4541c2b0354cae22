"""`hf-megatron reshard`: re-split a Megatron checkpoint to another TP / PP layout, without HF.

    hf-megatron reshard --src ckpt_tp2_pp2/ --out ckpt_tp4/ --tp 4 --pp 1 --verify

Model weights only: optimizer state is not carried over (restart the optimizer, or reshard
before training starts).  The iteration number and tokenizer files are kept.
"""
from __future__ import annotations

import argparse

from .convert import add_checksum_flag, add_output_format_flags


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("reshard", help="change the TP/PP layout of a Megatron checkpoint",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", required=True, help="Megatron checkpoint root or iter_* folder")
    parser.add_argument("--out", required=True, help="new checkpoint folder")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per stage")
    parser.add_argument("--verify", action="store_true", help="compare logits of source and result")
    add_checksum_flag(parser)
    add_output_format_flags(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from hf_megatron.commands.convert import _print_report, apply_checksum_flag
    apply_checksum_flag(args)
    from hf_megatron.conversion.convert import reshard
    _print_report(reshard(args.src, args.out, args.tp, args.pp, args.vpp, args.verify, args.ckpt_format,
                          args.legacy_names))
    return 0
