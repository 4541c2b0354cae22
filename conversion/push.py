"""Thin script: `python conversion/push.py --hf HF_DIR --repo-id ORG/NAME [--private]`
(same as `hf-megatron push`; the code lives in hf_megatron.conversion.hub)."""
import sys

from hf_megatron.cli import main

if __name__ == "__main__":
    sys.exit(main(["push", *sys.argv[1:]]))
