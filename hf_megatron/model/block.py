"""One pre-norm transformer layer:  x += drop(attn(norm1(x)));  x += drop(mlp(norm2(x)))."""
from __future__ import annotations

import torch
from torch import nn

from .attention import SelfAttention
from .mlp import MLP
from .norms import make_norm


class TransformerLayer(nn.Module):
    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        self.input_layernorm = make_norm(config, dtype=dtype, device=device)
        self.self_attention = SelfAttention(config, dtype=dtype, device=device)
        self.pre_mlp_layernorm = make_norm(config, dtype=dtype, device=device)
        self.mlp = MLP(config, dtype=dtype, device=device)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden: torch.Tensor, rotary=None, mask=None) -> torch.Tensor:
        hidden = hidden + self.hidden_dropout(self.self_attention(self.input_layernorm(hidden), rotary, mask))
        return hidden + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(hidden)))
