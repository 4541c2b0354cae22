"""One transformer layer.  Pre-norm (GPT-2, Llama, ...):
    x += drop(attn(norm1(x)));  x += drop(mlp(norm2(x)))
With `post_layernorm` the branch output is normalised before the residual add (Gemma: both
norms; OLMo 2: `pre_layernorm=False`, post-norms only):
    x += drop(post_norm1(attn(norm1(x))));  x += drop(post_norm2(mlp(norm2(x))))
"""
from __future__ import annotations

import torch
from torch import nn

from .attention import SelfAttention
from .mlp import MLP
from .norms import make_norm


def _optional_norm(config, present: bool, dtype, device) -> nn.Module | None:
    return make_norm(config, dtype=dtype, device=device) if present else None


class TransformerLayer(nn.Module):
    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        self.input_layernorm = _optional_norm(config, config.pre_layernorm, dtype, device)
        self.self_attention = SelfAttention(config, dtype=dtype, device=device)
        self.post_self_attn_layernorm = _optional_norm(config, config.post_layernorm, dtype, device)
        self.pre_mlp_layernorm = _optional_norm(config, config.pre_layernorm, dtype, device)
        self.mlp = MLP(config, dtype=dtype, device=device)
        self.post_mlp_layernorm = _optional_norm(config, config.post_layernorm, dtype, device)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    @staticmethod
    def _around(norm_before, branch, norm_after, x: torch.Tensor, *args) -> torch.Tensor:
        out = branch(norm_before(x) if norm_before is not None else x, *args)
        return norm_after(out) if norm_after is not None else out

    def forward(self, hidden: torch.Tensor, rotary=None, mask=None) -> torch.Tensor:
        hidden = hidden + self.hidden_dropout(self._around(self.input_layernorm, self.self_attention,
                                                           self.post_self_attn_layernorm, hidden, rotary, mask))
        return hidden + self.hidden_dropout(self._around(self.pre_mlp_layernorm, self.mlp, self.post_mlp_layernorm,
                                                         hidden))
