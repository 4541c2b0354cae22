"""Thin script: `python conversion/hf_to_megatron.py --hf ... --out ... --tp N --pp M [--verify]`
(same as `hf-megatron convert hf-to-megatron`; the code lives in hf_megatron.conversion)."""
import sys

from hf_megatron.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "hf-to-megatron", *sys.argv[1:]]))
