"""Self-attention with a fused, per-query-group QKV projection (megatron-core layout).

linear_qkv's output rows are ordered per query group g = 0..ng-1 as
    [q heads of g (nh/ng of them), k_g, v_g]  each head hn wide,
so a tensor-parallel rank owning groups [g0, g1) owns a contiguous row block: the module reads
how many groups it holds from its weight's shape, which is all that tensor parallelism changes.
With `qk_layernorm` (Qwen3) q and k are normalised per head over hn, after the projection and
before RoPE:  q_h <- norm(q_h), k_g <- norm(k_g), one [hn] weight shared by all heads (so under
tensor parallelism it is replicated and its gradient is summed over TP ranks, see
`parallel.parallelize`).  With `qk_layernorm_scope="projection"` (OLMo 2) the norms span the
whole projection instead: q <- norm(q) over all nh * hn values of a token (k over ng * hn),
one weight entry per value (tensor parallelism splits them with the heads and sums the squares
over ranks, `parallel.projection_norm`).

Attention itself is `scaled_dot_product_attention` (causal; optional key-padding mask and
sliding window; scale `softmax_scale`, default 1 / sqrt(hn)).  With logit soft-capping (Gemma 2)
it is written out, as transformers' eager attention:
    p = softmax(c * tanh(q k^T * scale / c) + mask) in fp32,   out = p v.
Activations enter and leave as [s, b, h].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .norms import make_norm
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


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(hn) + mask) v, with dropout on the probabilities. No parameters:
    the unit that selective recompute checkpoints (and that tensor parallelism gives its own
    dropout stream, since each rank holds other heads)."""

    def __init__(self, dropout: float, heads_per_group: int, scale: float | None = None,
                 softcap: float | None = None):
        super().__init__()
        self.dropout, self.heads_per_group = dropout, heads_per_group
        self.scale, self.softcap = scale, softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        if self.softcap is not None:
            return self._soft_capped(q, k, v, mask, dropout)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                              enable_gqa=self.heads_per_group > 1, scale=self.scale)

    def _soft_capped(self, q, k, v, mask, dropout: float) -> torch.Tensor:
        """q [b, nh, s, hn], k/v [b, ng, s, hn]: scores soft-capped before the mask (no SDPA kernel caps)."""
        k = k.repeat_interleave(self.heads_per_group, dim=1)
        v = v.repeat_interleave(self.heads_per_group, dim=1)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is None:
            s = q.shape[2]
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()[None, None]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(F.dropout(probs, p=dropout, training=dropout > 0), v)


class SelfAttention(nn.Module):
    def __init__(self, config, dtype=None, device=None):
        super().__init__()
        nh, ng, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels
        self.heads_per_group, self.head_dim = nh // ng, hn
        self.linear_qkv = nn.Linear(config.hidden_size, ng * (nh // ng + 2) * hn, bias=config.add_qkv_bias,
                                    dtype=dtype, device=device)
        self.q_layernorm = self.k_layernorm = None
        self.qk_norm_per_head = config.qk_layernorm_scope == "head"
        if config.qk_layernorm:
            per_head = self.qk_norm_per_head
            self.q_layernorm = make_norm(config, dtype=dtype, device=device, size=hn if per_head else nh * hn)
            self.k_layernorm = make_norm(config, dtype=dtype, device=device, size=hn if per_head else ng * hn)
        self.core_attention = CoreAttention(config.attention_dropout, nh // ng, config.softmax_scale,
                                            config.attn_logit_softcapping)
        self.linear_proj = nn.Linear(nh * hn, config.hidden_size, bias=config.add_proj_bias, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor, rotary: tuple | None, mask: torch.Tensor | None) -> torch.Tensor:
        qkv = self.linear_qkv(hidden)  # [s, b, groups * (hpg + 2) * hn]; groups = this rank's
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, -1, self.heads_per_group + 2, self.head_dim)
        q = qkv[:, :, :, : self.heads_per_group].reshape(s, b, -1, self.head_dim)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        if self.q_layernorm is not None and self.qk_norm_per_head:  # per head, over hn: [s, b, heads, hn]
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        elif self.q_layernorm is not None:  # over the whole (this rank's part of the) projection
            q = self.q_layernorm(q.flatten(2)).view_as(q)
            k = self.k_layernorm(k.flatten(2)).view_as(k)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, hn]
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core_attention(q, k, v, mask)  # [b, heads, s, hn]
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))
