"""Megatron-style parallelism applied to a plain model from outside: rank grid, collectives,
TP layers and `parallelize`, vocab-parallel loss, RNG streams, recompute, regional compile,
pipeline split."""
from . import comm, state
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelOutput
from .loss import vocab_parallel_cross_entropy
from .compile import apply_compile
from .parallelize import parallelize
from .recompute import apply_recompute
from .state import ParallelConfigError, get_state, initialize

__all__ = [
    "comm", "state", "initialize", "get_state", "ParallelConfigError", "parallelize", "apply_recompute",
    "apply_compile",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelOutput",
    "vocab_parallel_cross_entropy",
]
