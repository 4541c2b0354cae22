"""One pre-norm transformer layer:  x += drop(attn(norm1(x)));  x += drop(mlp(norm2(x)))."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.random import tp_rng
from .attention import SelfAttention
from .mlp import MLP
from .norms import make_norm


class TransformerLayer(nn.Module):
    def __init__(self, config, sequence_parallel: bool = False, recompute_core: bool = False,
                 dtype=None, device=None):
        super().__init__()
        self.input_layernorm = make_norm(config, dtype=dtype, device=device)
        self.self_attention = SelfAttention(config, sequence_parallel, recompute_core, dtype=dtype, device=device)
        self.pre_mlp_layernorm = make_norm(config, dtype=dtype, device=device)
        self.mlp = MLP(config, sequence_parallel, dtype=dtype, device=device)
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = sequence_parallel

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.hidden_dropout == 0.0:
            return x
        if self.sequence_parallel:  # each TP rank holds a different sequence shard
            with tp_rng():
                return F.dropout(x, self.hidden_dropout, True)
        return F.dropout(x, self.hidden_dropout, True)

    def forward(self, hidden: torch.Tensor, rotary=None, mask=None) -> torch.Tensor:
        hidden = hidden + self._dropout(self.self_attention(self.input_layernorm(hidden), rotary, mask))
        return hidden + self._dropout(self.mlp(self.pre_mlp_layernorm(hidden)))
