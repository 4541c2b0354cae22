"""Checkpoint conversion (HF <-> Megatron), on the weight mappings of `hf_megatron.architectures`.
The `conversion/` folder at the repository root holds only thin command scripts over this package."""
