"""`hf-megatron convert`: Hugging Face <-> Megatron checkpoints.

    hf-megatron convert hf-to-megatron --hf meta-llama/Llama-3.2-1B --out ckpt/ --tp 2 --pp 2 --verify
    hf-megatron convert megatron-to-hf --megatron ckpt/ --out hf_out/ --dtype bf16 --verify

The Megatron side is Megatron-LM's layout (latest_checkpointed_iteration.txt,
iter_*/mp_rank_TT[_PPP]/model_optim_rng.pt); megatron-to-hf also reads checkpoints written by
Megatron-LM itself (mcore or legacy names, torch or torch_dist format).  Outputs appear only
when complete.  --verify compares logits of source and result on a fixed prompt.  The flags of
Megatron-LM's tools/checkpoint/convert.py are accepted as other spellings: --load-dir (--hf /
--megatron), --save-dir (--out), --target-tensor-parallel-size (--tp),
--target-pipeline-parallel-size (--pp).
"""
from __future__ import annotations

import argparse
import re

from ..errors import ConfigError

SHARD_SIZE = re.compile(r"\s*\d+(\.\d*)?\s*[KMGT]B\s*", re.IGNORECASE)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("convert", help="convert checkpoints between HF and Megatron layouts",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    directions = parser.add_subparsers(dest="direction", metavar="<direction>", required=True)

    to_megatron = directions.add_parser("hf-to-megatron", help="HF folder or Hub id -> Megatron checkpoint")
    to_megatron.add_argument("--hf", "--load-dir", required=True, help="save_pretrained folder or Hub repo id")
    to_megatron.add_argument("--out", "--save-dir", required=True, help="new Megatron checkpoint folder")
    to_megatron.add_argument("--tp", "--target-tensor-parallel-size", type=int, default=1,
                             help="tensor-parallel size")
    to_megatron.add_argument("--pp", "--target-pipeline-parallel-size", type=int, default=1,
                             help="pipeline-parallel size")
    to_megatron.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per stage")
    to_megatron.add_argument("--dtype", default=None, help="store weights as fp32 | bf16 | fp16 (default: as is)")
    to_megatron.add_argument("--verify", action="store_true", help="compare logits of source and result")
    to_megatron.add_argument("--tokenizer", default=None,
                             help="tokenizer folder to carry into <out>/tokenizer (default: the --hf folder's own)")
    add_checksum_flag(to_megatron)
    add_output_format_flags(to_megatron)
    to_megatron.set_defaults(func=run_to_megatron)

    to_hf = directions.add_parser("megatron-to-hf", help="Megatron checkpoint -> HF folder (safetensors)")
    to_hf.add_argument("--megatron", "--load-dir", required=True,
                       help="checkpoint root (with the tracker) or an iter_* folder")
    to_hf.add_argument("--out", "--save-dir", required=True, help="new HF folder")
    to_hf.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: as stored)")
    to_hf.add_argument("--tokenizer", default=None, help="tokenizer folder to copy (default: <megatron>/tokenizer)")
    to_hf.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    to_hf.add_argument("--vocab-size", type=int, default=None,
                       help="true vocabulary size, for Megatron-LM checkpoints that store only the padded one")
    to_hf.add_argument("--verify", action="store_true", help="compare logits of source and result")
    add_checksum_flag(to_hf)
    to_hf.set_defaults(func=run_to_hf)


def add_checksum_flag(parser) -> None:
    parser.add_argument("--no-checkpoint-checksums", action="store_true",
                        help="neither write nor verify the sha256 sidecars of Megatron tensor files")


def apply_checksum_flag(args) -> None:
    from hf_megatron.checkpoint.checksums import set_checksums
    set_checksums(False if args.no_checkpoint_checksums else None)


def add_output_format_flags(parser) -> None:
    """How a Megatron output is written (hf-to-megatron, reshard)."""
    parser.add_argument("--ckpt-format", default="torch", choices=["torch", "torch_dist"],
                        help="torch: mp_rank_* rank files (default); torch_dist: megatron-core's distributed "
                             "checkpoint (torch.distributed.checkpoint), loadable at any TP/PP")
    parser.add_argument("--legacy-names", action="store_true",
                        help="torch format with Megatron-LM's pre-mcore names (language_model.encoder...), "
                             "for older readers such as transformers' convert_megatron_gpt2_checkpoint.py")


def _print_report(report: dict) -> None:
    if "verify" in report:
        print(report["verify"])
    if report.get("tokenizer_files") == []:
        print("note: no tokenizer files found to copy (pass --tokenizer DIR, or copy them yourself)")
    print(f"wrote {report['out']}")


def run_to_megatron(args) -> int:
    from hf_megatron.conversion.convert import hf_to_megatron
    apply_checksum_flag(args)
    _print_report(hf_to_megatron(args.hf, args.out, args.tp, args.pp, args.vpp, args.dtype, args.verify,
                                 args.ckpt_format, args.legacy_names, args.tokenizer))
    return 0


def run_to_hf(args) -> int:
    from hf_megatron.conversion.convert import megatron_to_hf
    apply_checksum_flag(args)
    if not SHARD_SIZE.fullmatch(args.max_shard_size):  # huggingface_hub's format, checked before any work
        raise ConfigError(f"--max-shard-size: expected a size like 5GB or 500MB (units KB, MB, GB, TB), "
                          f"got {args.max_shard_size!r}")
    _print_report(megatron_to_hf(args.megatron, args.out, args.dtype, args.tokenizer, args.max_shard_size,
                                 args.verify, args.vocab_size))
    return 0
