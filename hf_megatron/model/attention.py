"""Self-attention with a fused, per-query-group QKV projection (megatron-core layout).

linear_qkv's output rows are ordered per query group g = 0..ng-1 as
    [q heads of g (nh/ng of them), k_g, v_g]  each head hn wide,
so a tensor-parallel rank owning groups [g0, g1) owns a contiguous row block.  Attention
itself is `scaled_dot_product_attention` (causal; optional key-padding mask and sliding
window).  Activations enter and leave as [s, b, h] (sequence-sharded with SP).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..parallel import state
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..parallel.random import replayable, tp_rng
from .rotary import apply_rotary


def build_attention_mask(seq_len: int, attention_mask: torch.Tensor | None, sliding_window: int | None,
                         device) -> torch.Tensor | None:
    """Boolean mask [b or 1, 1, s, s] (True = may attend), or None for plain causal."""
    if attention_mask is None and (sliding_window is None or sliding_window >= seq_len):
        return None
    q = torch.arange(seq_len, device=device)[:, None]
    k = torch.arange(seq_len, device=device)[None, :]
    allowed = k <= q
    if sliding_window is not None:
        allowed = allowed & (q - k < sliding_window)
    allowed = allowed[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]
        # a fully padded query row would give NaN; let it see itself (its output is ignored)
        allowed = allowed | torch.eye(seq_len, dtype=torch.bool, device=device)[None, None]
    return allowed


class SelfAttention(nn.Module):
    def __init__(self, config, sequence_parallel: bool = False, recompute_core: bool = False,
                 dtype=None, device=None):
        super().__init__()
        tp = state.tp_size()
        nh, ng, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels
        if ng % tp:
            raise ValueError(
                f"num_query_groups (num_key_value_heads)={ng} is not divisible by tensor parallel size {tp}; "
                f"use tp <= {ng} and a divisor of it"
            )
        self.heads_per_group, self.local_groups, self.head_dim = nh // ng, ng // tp, hn
        self.dropout = config.attention_dropout
        self.sliding_window = config.sliding_window
        self.recompute_core = recompute_core
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, ng * (nh // ng + 2) * hn, bias=config.add_qkv_bias,
                                               sequence_parallel=sequence_parallel, dtype=dtype, device=device)
        self.linear_proj = RowParallelLinear(nh * hn, config.hidden_size, bias=config.add_proj_bias,
                                             sequence_parallel=sequence_parallel, dtype=dtype, device=device)

    def _core(self, q, k, v, mask):
        dropout = self.dropout if self.training else 0.0
        with tp_rng():  # local heads differ per TP rank, so must their dropout masks
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                  is_causal=mask is None, enable_gqa=self.heads_per_group > 1)

    def forward(self, hidden: torch.Tensor, rotary: tuple | None, mask: torch.Tensor | None) -> torch.Tensor:
        qkv = self.linear_qkv(hidden)  # [s, b, local_groups * (hpg + 2) * hn]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.local_groups, self.heads_per_group + 2, self.head_dim)
        q = qkv[:, :, :, : self.heads_per_group].reshape(s, b, -1, self.head_dim)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, hn]
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            out = checkpoint(replayable(self._core), q, k, v, mask, use_reentrant=False)
        else:
            out = self._core(q, k, v, mask)
        out = out.permute(2, 0, 1, 3).reshape(s, b, -1)
        return self.linear_proj(out)
