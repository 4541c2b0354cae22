"""The tensor-parallel form of an RMSNorm over a whole attention projection (OLMo 2's q/k norms).

The norm spans all heads of a token, x = [x_1, ..., x_p] over the p TP ranks (rank r holds the
values of its own heads, n_r of the N in all), and its weight is split with them (column style):

    y_r = w_r * x_r / sqrt(S / N + eps),   S = sum_r sum(x_r^2)

so each rank all-reduces its partial sum of squares.  Every rank's result depends on S, so the
gradient of S is the sum of each rank's share: the all-reduce's backward is an all-reduce too
(copy_to_tp then reduce_from_tp: all-reduce forward and backward).  The weight gradient is
local and exact (no TP sum, unlike the per-head norms).
"""
from __future__ import annotations

import torch
from torch import nn

from . import comm
from .layers import _param


class ProjectionRMSNorm(nn.Module):
    def __init__(self, norm: nn.Module, group):
        super().__init__()
        self.group, self.eps = group, norm.eps
        self.full_size = norm.weight.shape[0]
        self.weight = _param(norm.weight, "column", 1, group, norm.weight.requires_grad)
        self.weight.tensor_parallel_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = comm.reduce_from_tp(comm.copy_to_tp(x32.pow(2).sum(-1, keepdim=True), self.group), self.group)
        return self.weight * (x32 * torch.rsqrt(squares / self.full_size + self.eps)).to(x.dtype)
