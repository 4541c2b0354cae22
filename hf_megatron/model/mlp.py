"""The MLP: linear_fc1 -> activation -> linear_fc2.

SwiGLU: fc1 produces [gate; up] (per tensor-parallel rank: [gate_r; up_r], so each rank
applies silu(gate_r) * up_r on its own columns), y = fc2(silu(gate) * up).
GELU (GPT-2): y = fc2(gelu_tanh(fc1 x)).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, config, sequence_parallel: bool = False, dtype=None, device=None):
        super().__init__()
        self.activation = config.activation
        fc1_out = config.ffn_hidden_size * (2 if config.gated_mlp else 1)
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, fc1_out, bias=config.add_mlp_bias,
                                               sequence_parallel=sequence_parallel, dtype=dtype, device=device)
        self.linear_fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, bias=config.add_mlp_bias,
                                            sequence_parallel=sequence_parallel, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.activation == "swiglu":
            h = kernels.swiglu(h)  # silu(gate) * up
        elif self.activation == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")
        else:
            h = F.gelu(h)
        return self.linear_fc2(h)
