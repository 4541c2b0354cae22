"""The Megatron-layout GPT model (read top to bottom: norms, rotary, attention, mlp, block, gpt)."""
from .gpt import GPTModel, GPTOutput

__all__ = ["GPTModel", "GPTOutput"]
