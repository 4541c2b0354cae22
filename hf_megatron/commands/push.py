"""`hf-megatron push`: upload a converted HF folder to the Hub with a generated model card.

    hf-megatron push --hf hf_out/ --repo-id my-org/my-model --private --revision v1

The token is read from HF_TOKEN or the `hf auth login` file and never printed.  The folder is
checked first (config.json, complete weights files, every shard its index lists, no symlink out
of the folder; a bad one is one line and nothing is uploaded) and never written to.  README.md
(the model card: architecture, hf_megatron version, and iterations, tokens, final loss, parallel
layout when it was trained -- or that it was converted) is generated and uploaded from memory,
unless the folder already has a README of your own.  --dry-run makes every check and the card,
lists what would be uploaded and stops: no token, no network.
"""
from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("push", help="upload an HF folder to the Hugging Face Hub with a model card",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", required=True, help="folder written by `convert megatron-to-hf`")
    parser.add_argument("--repo-id", required=True, help="ORG/NAME on the Hub (created if missing)")
    parser.add_argument("--private", action="store_true", help="create the repo as private")
    parser.add_argument("--revision", default=None, help="branch to push to (created if missing)")
    parser.add_argument("--dry-run", action="store_true",
                        help="run every local check and generate the model card, then list the files (sizes) "
                             "that would be uploaded and the card's first lines; no token, no network")
    parser.set_defaults(func=run)


def run(args) -> int:
    from hf_megatron.conversion.hub import dry_run, push
    if args.dry_run:
        print(dry_run(args.hf, args.repo_id, private=args.private, revision=args.revision))
        return 0
    print(f"pushed: {push(args.hf, args.repo_id, private=args.private, revision=args.revision)}")
    return 0
