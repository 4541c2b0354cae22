"""Thin script: `python conversion/megatron_to_hf.py --megatron ... --out ... [--dtype bf16] [--verify]`
(same as `hf-megatron convert megatron-to-hf`; the code lives in hf_megatron.conversion)."""
import sys

from hf_megatron.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "megatron-to-hf", *sys.argv[1:]]))
