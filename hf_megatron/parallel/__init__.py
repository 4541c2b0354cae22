"""Megatron-style parallelism: rank grid, collectives, TP layers, vocab-parallel loss, RNG."""
from . import comm, state
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .loss import vocab_parallel_cross_entropy
from .state import ParallelConfigError, get_state, initialize

__all__ = [
    "comm", "state", "initialize", "get_state", "ParallelConfigError",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
]
