"""Cross entropy over vocab-parallel logits, without gathering the full logits.

Rank r holds logits z[..., v] for v in [vocab_start, vocab_end).  With m = max_v z_v
(all-reduce MAX, no gradient needed: it cancels),

    loss = log sum_v exp(z_v - m) + m - z_target
         = log(all_reduce_sum(sum_{v local} exp(z_v - m))) + m - all_reduce_sum(z_target if local)

Both sums go through `reduce_from_tp`, whose backward is the identity, so autograd gives
each rank d loss / d z_local = softmax_local - onehot_local.  Logit columns at or past
`vocab_size` (Megatron's vocab padding) are masked to -inf, so padded rows never touch the
loss.  Targets equal to `ignore_index` give loss 0.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from . import comm


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int | None = None,
                                 ignore_index: int = -100, group=None) -> torch.Tensor:
    """Per-token losses (fp32), shape of `target`. `logits` is [..., padded_vocab / tp]."""
    logits = logits.float()
    per_rank = logits.shape[-1]
    vocab_start = comm.group_rank(group) * per_rank
    columns = torch.arange(vocab_start, vocab_start + per_rank, device=logits.device)
    if vocab_size is not None and vocab_start + per_rank > vocab_size:
        logits = logits.masked_fill(columns >= vocab_size, float("-inf"))

    with torch.no_grad():
        max_logit = logits.max(dim=-1).values
        if comm.group_size(group) > 1:
            dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - max_logit.unsqueeze(-1)

    ignored = target == ignore_index
    local_target = target - vocab_start
    outside = (local_target < 0) | (local_target >= per_rank) | ignored
    local_target = local_target.masked_fill(outside, 0)
    picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

    sum_exp = comm.reduce_from_tp(shifted.exp().sum(dim=-1), group)
    target_logit = comm.reduce_from_tp(picked, group)
    loss = torch.log(sum_exp) - target_logit
    return loss.masked_fill(ignored, 0.0)


class VocabParallelLoss(nn.Module):
    """The plain model's `vocab_loss` under tensor parallelism: the loss above, and full logits
    gathered over the group (padding removed)."""

    def __init__(self, vocab_size: int, group):
        super().__init__()
        self.vocab_size, self.group = vocab_size, group

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, keep_logits: bool = True) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_size, group=self.group)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return comm.gather_from_tp(logits, self.group, -1)[..., : self.vocab_size]
