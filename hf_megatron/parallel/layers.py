"""Tensor-parallel replacements for the plain model's nn.Linear / nn.Embedding / output layer.

`parallelize` swaps them in from outside; each holds its tensor-parallel group and this rank's
shard (cut from the plain module's full weight by `sharding.shard_tensor`, on the meta device
or materialised alike).

ColumnParallelLinear:  Y = X A^T + b,  A split by output rows: rank r holds A_r (weight
    [out/p, in]) and b_r and computes Y_r = X A_r^T + b_r.  Its input is replicated
    (copy_to_tp: backward all-reduces dX) or, with sequence parallelism, all-gathered along the
    sequence first (backward reduce-scatters).
    With `gradient_accumulation_fusion` (set by `wgrad.apply_wgrad_fusion`) both linears
    accumulate dA_r = dY_r^T X straight into A_r's fp32 main_grad (X: the gathered input).
RowParallelLinear:  Y = X A^T + b,  A split by input columns: rank r holds A_r (weight
    [out, in/p]) and computes X_r A_r^T; the partial sums are all-reduced (or reduce-scattered
    along the sequence); the replicated bias is added once, after the reduction.
VocabParallelEmbedding:  rank r owns rows [vocab_start, vocab_end) of the padded table; ids
    outside look up zeros and the partial lookups are summed: all-reduce, or with sequence
    parallelism a reduce-scatter that leaves this rank's sequence chunk.
VocabParallelOutput:  logits_r = X W_r^T over this rank's vocabulary rows (input copied or
    sequence-gathered as for a column-parallel linear).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import comm, wgrad
from .sharding import pad_vocab, shard_tensor


def _param(full: torch.Tensor, style: str, parts: int, group, requires_grad: bool = True) -> nn.Parameter:
    shard = shard_tensor(full.detach(), style, 0 if style != "row" else 1, parts,
                         comm.group_size(group))[comm.group_rank(group)]
    return nn.Parameter(shard.clone() if shard.device.type != "meta" else shard, requires_grad=requires_grad)


class ColumnParallelLinear(nn.Linear):
    def __init__(self, linear: nn.Linear, group, parts: int = 1, sequence_parallel: bool = False):
        nn.Module.__init__(self)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.gradient_accumulation_fusion = False
        self.in_features = linear.in_features
        self.weight = _param(linear.weight, "column", parts, group, linear.weight.requires_grad)
        self.out_features = self.weight.shape[0]
        self.bias = None if linear.bias is None else _param(linear.bias, "column", parts, group,
                                                            linear.bias.requires_grad)
        self.weight.tensor_parallel_dim = 0
        if self.bias is not None:
            self.bias.tensor_parallel_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = comm.column_input(x, self.group, self.sequence_parallel)
        return (wgrad.linear if self.gradient_accumulation_fusion else F.linear)(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    def __init__(self, linear: nn.Linear, group, sequence_parallel: bool = False):
        nn.Module.__init__(self)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.gradient_accumulation_fusion = False
        self.out_features = linear.out_features
        self.weight = _param(linear.weight, "row", 1, group, linear.weight.requires_grad)
        self.in_features = self.weight.shape[1]
        self.weight.tensor_parallel_dim = 1
        # the bias is replicated; with sequence parallelism it is added on a sequence shard, so
        # its gradient is partial and must be summed over TP (see `sequence_parallel` tag)
        self.bias = linear.bias
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (wgrad.linear if self.gradient_accumulation_fusion else F.linear)(x, self.weight)
        y = comm.sp_reduce_scatter(y, self.group) if self.sequence_parallel else comm.reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, embedding: nn.Embedding, group, padded_vocab: int, sequence_parallel: bool = False):
        nn.Module.__init__(self)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _param(pad_vocab(embedding.weight, padded_vocab), "vocab", 1, group, embedding.weight.requires_grad)
        self.weight.tensor_parallel_dim = 0
        self.num_embeddings, self.embedding_dim = self.weight.shape
        self.vocab_start = comm.group_rank(group) * self.num_embeddings
        self.vocab_end = self.vocab_start + self.num_embeddings
        self.padding_idx, self.max_norm, self.norm_type = None, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:  # ids are [s, b]: leave this rank's sequence chunk
            return comm.sp_reduce_scatter(out, self.group)
        return comm.reduce_from_tp(out, self.group)


class VocabParallelOutput(nn.Module):
    """The output layer over this rank's vocabulary rows (weight None: tied to the embedding)."""

    def __init__(self, output_layer: nn.Module, group, padded_vocab: int, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        weight = output_layer.weight
        self.weight = None if weight is None else _param(pad_vocab(weight, padded_vocab), "vocab", 1, group,
                                                         weight.requires_grad)
        if self.weight is not None:
            self.weight.tensor_parallel_dim = 0

    def forward(self, x: torch.Tensor, tied_weight: torch.Tensor | None = None) -> torch.Tensor:
        x = comm.column_input(x, self.group, self.sequence_parallel)
        return F.linear(x, self.weight if self.weight is not None else tied_weight)

