"""Output layer and cross entropy fused, chunk by chunk: the [tokens, vocab] logits never exist whole.

    apply_fused_linear_loss(model)     # after parallelize, before compile / recompute
    out = model(input_ids, targets=targets, return_logits=False)   # out.loss_sum as before

For a chunk of c token rows H_c [c, h] against this rank's vocabulary rows W [V_r, h]
(rank r owns columns [v0, v0 + V_r) of the padded vocabulary; columns >= vocab_size are padding):

    Z = H_c W^T (model dtype, then fp32)          m = max_v Z   (all-reduce MAX over TP)
    S = sum_v exp(Z - m)  (all-reduce SUM)        z_t = Z[target] on the rank that owns it (SUM)
    loss_i = log S_i + m_i - z_t,i                (0 where target = -100)
    dL/dZ = softmax(Z) - onehot(target) = P       (rows of ignored targets: 0)
    dL/dH_c = P W      (partial over TP: the input's copy_to_tp / sp_gather backward sums it)
    dL/dW  += P^T H_c  (fp32 accumulator over chunks; on CUDA the GEMM adds into it directly)

The forward returns the summed loss and already holds both gradients (Liger's trick: no second
pass over the vocabulary in backward); backward scales them by the incoming scalar gradient.  That
is exact because the training loss is a scalar multiple of the summed token losses.  Peak extra
memory is one fp32 chunk [c, V_r] (~`chunk_bytes`) plus an fp32 [V_r, h] weight-gradient buffer,
instead of bf16 logits + fp32 upcast + bf16 logit grads for every token.  Only the training path
(targets given, `return_logits=False`) is fused; asking for logits takes the unfused path.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..model.gpt import IGNORE_INDEX
from . import comm
from .wgrad import fp32_accumulating_gemm


def _chunk_stats(z: torch.Tensor, local_target: torch.Tensor, inside: torch.Tensor, vocab_limit: int):
    """fp32 logits of a chunk with padding masked, their row max, and the owned target logit."""
    z = z.float()
    if vocab_limit < z.shape[-1]:
        z[:, vocab_limit:] = float("-inf")
    row_max = z.max(dim=-1).values
    picked = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
    return z, row_max, picked


def _chunk_probs(z: torch.Tensor, row_max: torch.Tensor, vocab_limit: int):
    """exp(z - m) in place, and its row sum."""
    z.sub_(row_max.unsqueeze(-1)).exp_()
    return z, z.sum(dim=-1)


def _chunk_loss(sum_exp, row_max, picked, ignored):
    return (torch.log(sum_exp) + row_max - picked).masked_fill(ignored, 0.0).sum()


def _chunk_grad(e: torch.Tensor, sum_exp, row_max, picked, local_target, inside, ignored, dtype, vocab_limit: int):
    """Summed chunk loss and P = softmax - onehot in `dtype` (rows of ignored targets zero)."""
    loss = _chunk_loss(sum_exp, row_max, picked, ignored)
    e.div_(sum_exp.unsqueeze(-1))
    e.scatter_add_(1, local_target.unsqueeze(-1), -inside.to(e.dtype).unsqueeze(-1))
    return loss, e.masked_fill_(ignored.unsqueeze(-1), 0.0).to(dtype)


EAGER = (_chunk_stats, _chunk_probs, _chunk_grad)


# For torch.compile: the same numbers as EAGER, written as pure functions of the chunk's raw logits
# (the GEMM output, bf16 in bf16 training), so that inductor fuses each into one pass that widens to
# fp32 in registers: the logits are read three times (max, sum of exp, gradient) and the bf16 P
# written once -- ~8 bytes per logit instead of EAGER's fp32 copy and in-place passes (~40), and no
# fp32 [chunk, vocab] buffer.  EAGER stays the uncompiled path: in eager mode these would allocate a
# temporary per operation.

def _widened(z: torch.Tensor, vocab_limit: int) -> torch.Tensor:
    """The chunk in fp32 with the padding columns (>= vocab_limit) at -inf."""
    z = z.float()
    if vocab_limit < z.shape[-1]:
        columns = torch.arange(z.shape[-1], device=z.device)
        z = torch.where(columns < vocab_limit, z, float("-inf"))
    return z


def _fused_stats(z: torch.Tensor, local_target, inside, vocab_limit: int):
    w = _widened(z, vocab_limit)
    picked = w.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
    return z, w.amax(dim=-1), picked


def _fused_probs(z: torch.Tensor, row_max: torch.Tensor, vocab_limit: int):
    return z, torch.exp(_widened(z, vocab_limit) - row_max.unsqueeze(-1)).sum(dim=-1)


def _fused_grad(z: torch.Tensor, sum_exp, row_max, picked, local_target, inside, ignored, dtype, vocab_limit: int):
    loss = _chunk_loss(sum_exp, row_max, picked, ignored)
    p = torch.exp(_widened(z, vocab_limit) - row_max.unsqueeze(-1)) / sum_exp.unsqueeze(-1)
    columns = torch.arange(z.shape[-1], device=z.device)
    target = (columns == local_target.unsqueeze(-1)) & inside.unsqueeze(-1)
    p = torch.where(target, p - 1.0, p).masked_fill(ignored.unsqueeze(-1), 0.0)
    return loss, p.to(dtype)


COMPILED = (_fused_stats, _fused_probs, _fused_grad)


def _add_matmul_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc += a @ b for an fp32 acc.  On CUDA with bf16/fp16 a, b -- where this torch's addmm takes
    an fp32 `self` with low-precision inputs (probed once per device, the probe the fused wgrad
    uses) -- the GEMM accumulates into acc itself (cuBLAS beta = 1, aten::addmm.dtype_out): no
    [V_r, h] product rounded to bf16, written and read back once per chunk.  Elsewhere the product
    is formed, then added."""
    if (acc.is_cuda and acc.dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16)
            and fp32_accumulating_gemm(acc.device)):
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.add_(a @ b)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_size: int, chunk_rows: int, group, fns=EAGER):
        stats, probs, grad = fns
        rows, per_rank = hidden.shape[0], weight.shape[0]
        vocab_start = comm.group_rank(group) * per_rank
        vocab_limit = max(0, min(per_rank, vocab_size - vocab_start))  # local columns that are real
        tp = comm.group_size(group)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if weight.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, rows, chunk_rows):
            h, t = hidden[start:start + chunk_rows], targets[start:start + chunk_rows]
            ignored = t == IGNORE_INDEX
            local_target = t - vocab_start
            inside = (local_target >= 0) & (local_target < per_rank) & ~ignored
            local_target = local_target.masked_fill(~inside, 0)
            z, row_max, picked = stats(h @ weight.t(), local_target, inside, vocab_limit)
            if tp > 1:
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
                dist.all_reduce(picked, group=group)
            e, sum_exp = probs(z, row_max, vocab_limit)
            if tp > 1:
                dist.all_reduce(sum_exp, group=group)
            loss, p = grad(e, sum_exp, row_max, picked, local_target, inside, ignored, hidden.dtype, vocab_limit)
            total += loss
            grad_hidden[start:start + chunk_rows] = p @ weight
            if grad_weight is not None:
                _add_matmul_(grad_weight, p.t(), h)
        ctx.save_for_backward(grad_hidden, grad_weight if grad_weight is not None else torch.empty(0))
        ctx.weight_dtype, ctx.has_weight_grad = weight.dtype, grad_weight is not None
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        dh = grad_hidden * grad_total.to(grad_hidden.dtype)
        dw = (grad_weight * grad_total).to(ctx.weight_dtype) if ctx.has_weight_grad else None
        return dh, dw, None, None, None, None, None


class FusedLinearLoss(nn.Module):
    """Replaces the model's `vocab_loss`: `linear_loss_sum` computes the output layer and the summed
    cross entropy in chunks; `forward` / `full_logits` keep the unfused path for logits."""

    fused_with_output = True

    def __init__(self, inner: nn.Module, group=None, sequence_parallel: bool = False, chunk_bytes: int = 2 ** 29):
        super().__init__()
        self.inner, self.group, self.sequence_parallel = inner, group, sequence_parallel
        self.vocab_size, self.chunk_bytes = inner.vocab_size, chunk_bytes
        self.fns = EAGER

    def compile_chunks(self, guard=None, **compile_kwargs) -> None:
        """torch.compile the per-chunk elementwise work (called by parallel.compile.apply_compile):
        COMPILED's three passes, each one fused kernel over the raw logits (see above); `guard`: the
        model's compile.EagerFallback, or None."""
        compiled = (torch.compile(fn, **compile_kwargs) for fn in COMPILED)
        self.fns = tuple(c if guard is None else guard.guard(c, fn) for c, fn in zip(compiled, COMPILED))

    def forward(self, logits, targets, keep_logits: bool = True):
        return self.inner(logits, targets, keep_logits=keep_logits)

    def full_logits(self, logits):
        return self.inner.full_logits(logits)

    def linear_loss_sum(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """hidden [s(/tp), b, h] after the final norm, weight [V_r, h], targets [s, b] -> fp32 sum."""
        hidden = comm.column_input(hidden, self.group, self.sequence_parallel)  # as the output layer's input
        flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        chunk_rows = max(1, self.chunk_bytes // (4 * weight.shape[0]))
        chunks = math.ceil(flat.shape[0] / chunk_rows)
        chunk_rows = math.ceil(flat.shape[0] / chunks)  # even chunks: at most two shapes
        return _FusedLinearCrossEntropy.apply(flat, weight, flat_targets, self.vocab_size, chunk_rows, self.group,
                                              self.fns)


def apply_fused_linear_loss(model: nn.Module, chunk_bytes: int = 2 ** 29) -> nn.Module:
    """Swap `model.vocab_loss` (plain or vocab-parallel) for the fused version, in place."""
    loss = getattr(model, "vocab_loss", None)
    if loss is None or isinstance(loss, FusedLinearLoss):
        return model
    if getattr(model.config, "final_logit_softcapping", None) is not None:
        raise ConfigError("cross-entropy loss fusion (--cross-entropy-loss-fusion): not supported with "
                          "final_logit_softcapping (Gemma 2); train without the fusion")
    group = getattr(model, "tp_group", None) if comm.group_size(getattr(model, "tp_group", None)) > 1 else None
    model.vocab_loss = FusedLinearLoss(loss, group, getattr(model, "sequence_parallel", False), chunk_bytes)
    return model
