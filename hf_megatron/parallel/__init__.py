"""Megatron-style parallelism applied to a plain model from outside: rank grid, collectives,
TP layers and `parallelize`, vocab-parallel loss, RNG streams, recompute, regional compile,
pipeline split, weight-gradient accumulation fusion."""
from . import comm, state
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelOutput
from .loss import vocab_parallel_cross_entropy
from .compile import apply_compile
from .parallelize import parallelize
from .recompute import apply_recompute
from .state import ParallelConfigError, get_state, initialize
from .wgrad import apply_wgrad_fusion

__all__ = [
    "comm", "state", "initialize", "get_state", "ParallelConfigError", "parallelize", "apply_recompute",
    "apply_compile", "apply_wgrad_fusion",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelOutput",
    "vocab_parallel_cross_entropy",
]
