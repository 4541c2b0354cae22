"""One module per `hf-megatron` verb (see hf_megatron/cli.py)."""
