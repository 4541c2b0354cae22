"""Thin script: `python conversion/reshard.py --src ... --out ... --tp N --pp M`
(same as `hf-megatron reshard`; the code lives in hf_megatron.conversion)."""
import sys

from hf_megatron.cli import main

if __name__ == "__main__":
    sys.exit(main(["reshard", *sys.argv[1:]]))
