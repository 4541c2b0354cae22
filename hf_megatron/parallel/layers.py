"""Tensor-parallel linear and embedding layers (Megatron-style).

ColumnParallelLinear:  Y = X A + b,  A = [A_1 ... A_p] split by output columns.
    Rank r holds A_r (stored as weight[out/p, in], dim 0 of the torch weight) and b_r, and
    computes Y_r = X A_r + b_r.  Input X is replicated (copy_to_tp: backward all-reduces
    dX) or, with sequence parallelism, all-gathered along the sequence first.

RowParallelLinear:  Y = X A + b,  A = [A_1; ...; A_p] split by input rows.
    Rank r holds A_r (weight[out, in/p], dim 1) and computes X_r A_r; the partial sums are
    all-reduced (or reduce-scattered along the sequence with sequence parallelism); the
    bias is added once, after the reduction.

VocabParallelEmbedding:  rank r owns rows [vocab_start, vocab_end) of the padded table;
    tokens outside its range look up zeros, and an all-reduce (or reduce-scatter with SP)
    sums the partial lookups (callers that reduce-scatter instead pass reduce_output=False).

With tp == 1 these are ordinary nn.Linear / nn.Embedding computations.  Weights are
created at the *local* (per-rank) shape; loading full weights goes through
`hf_megatron.conversion.layout`, which shards them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import comm, state


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        tp = state.tp_size()
        if out_features % tp:
            raise ValueError(f"ColumnParallelLinear: out_features={out_features} not divisible by tp={tp}")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features // tp, dtype=dtype, device=device)) if bias else None
        self.weight.tensor_parallel_dim = 0
        if self.bias is not None:
            self.bias.tensor_parallel_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = comm.sp_gather(x) if self.sequence_parallel else comm.copy_to_tp(x)
        y = F.linear(x, self.weight, self.bias)
        return comm.gather_from_tp(y, -1) if self.gather_output else y


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        tp = state.tp_size()
        if in_features % tp:
            raise ValueError(f"RowParallelLinear: in_features={in_features} not divisible by tp={tp}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel requires input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, dtype=dtype, device=device))
        self.weight.tensor_parallel_dim = 1
        # the bias is replicated on every TP rank (its grad is identical everywhere; with SP
        # it is computed on a sequence shard and must be all-reduced over TP -- see
        # `sequence_parallel` attribute, used by the optimizer's grad sync)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = comm.scatter_to_tp(x, -1)
        y = F.linear(x, self.weight)
        y = comm.sp_reduce_scatter(y) if self.sequence_parallel else comm.reduce_from_tp(y)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    def __init__(self, padded_vocab_size: int, hidden_size: int, reduce_output: bool = True,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        tp, rank = state.tp_size(), state.tp_rank()
        if padded_vocab_size % tp:
            raise ValueError(f"VocabParallelEmbedding: padded vocab {padded_vocab_size} not divisible by tp={tp}")
        per_rank = padded_vocab_size // tp
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.padded_vocab_size = padded_vocab_size
        self.reduce_output = reduce_output  # False: return this rank's partial lookup
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size, dtype=dtype, device=device))
        self.weight.tensor_parallel_dim = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if state.tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return comm.reduce_from_tp(out) if self.reduce_output else out
