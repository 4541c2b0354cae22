"""The MLP: linear_fc1 -> activation -> linear_fc2.

SwiGLU: fc1 produces [gate; up] (under tensor parallelism each rank holds [gate_r; up_r], so
the same split of its own output applies), y = fc2(silu(gate) * up).
GeGLU (Gemma): the same with gelu_tanh for silu, y = fc2(gelu_tanh(gate) * up).
GELU (GPT-2): y = fc2(gelu_tanh(fc1 x)).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels


class MLP(nn.Module):
    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        self.activation = config.activation
        fc1_out = config.ffn_hidden_size * (2 if config.gated_mlp else 1)
        self.linear_fc1 = nn.Linear(config.hidden_size, fc1_out, bias=config.add_mlp_bias, dtype=dtype, device=device)
        self.linear_fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=config.add_mlp_bias,
                                    dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.activation == "swiglu":
            h = kernels.swiglu(h)  # silu(gate) * up
        elif self.activation == "geglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.gelu(gate, approximate="tanh") * up
        elif self.activation == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")
        else:
            h = F.gelu(h)
        return self.linear_fc2(h)
