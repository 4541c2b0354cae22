"""Weight mappings and checkpoint conversion (HF <-> Megatron).  The `conversion/` folder at
the repository root holds only thin command scripts over this package."""
