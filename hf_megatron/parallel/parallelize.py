"""Apply tensor (and sequence) parallelism to a plain GPTModel from outside.

    plan = architectures.plan_for(config)     # {"decoder.layers.*.mlp.linear_fc1": Shard("column", 2), ...}
    parallelize(model, plan, tp_group, sequence_parallel=True)

Every module the plan names is swapped for its tensor-parallel version holding this rank's
shard (works on the meta device, before weights exist, and on a materialised model, whose
weights are cut); the same plan drives the checkpoint split/merge (`sharding`), so module
shapes and files agree.  The rest follows from where activations are split:

* core attention sees this rank's heads only, so its dropout draws from the tensor-parallel
  RNG stream (`random.tp_rng`), as do all dropouts inside the sequence-parallel region;
* with sequence parallelism the word-embedding lookup reduce-scatters, position embeddings
  are scattered along the sequence, and the parameters that see a sequence shard only (norms,
  row-parallel biases) are tagged `sequence_parallel` so their gradients are summed over TP;
* per-head q/k norms (`qk_layernorm`) get the same tag at any tp > 1, with or without SP: one
  [hn] weight serves every head and each rank holds only its own heads, so its gradient is a
  partial sum over heads (megatron-core's finalize_model_grads sums q/k_layernorm over TP too);
* q/k norms over the whole projection (OLMo 2; the plan splits them "column" with the heads)
  become `projection_norm.ProjectionRMSNorm`, which sums the squares over TP;
* the loss becomes the vocab-parallel cross entropy (the full logits are never gathered for it).
"""
from __future__ import annotations

import torch
from torch import nn

from ..architectures.plan import module_rule
from ..errors import ParallelConfigError
from ..model.gpt import OutputLayer, VocabLoss
from ..model.norms import RMSNorm
from . import comm
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelOutput
from .loss import VocabParallelLoss
from .projection_norm import ProjectionRMSNorm
from .random import tp_rng


class TPDropout(nn.Dropout):
    """Dropout drawing from the tensor-parallel RNG stream (activations differ per TP rank)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with tp_rng():
            return super().forward(x)


class TPRNGFork(nn.Module):
    """Runs a parameter-free module (core attention) on the tensor-parallel RNG stream."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        with tp_rng():
            return self.inner(*args, **kwargs)


def _swap(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, new)


def _parallel_module(module: nn.Module, rule, group, sequence_parallel: bool, padded_vocab: int):
    if rule.style == "column" and isinstance(module, nn.Linear):
        return ColumnParallelLinear(module, group, rule.parts, sequence_parallel)
    if rule.style == "row" and isinstance(module, nn.Linear):
        return RowParallelLinear(module, group, sequence_parallel)
    if rule.style == "column" and type(module) is RMSNorm:  # a whole-projection q/k norm
        return ProjectionRMSNorm(module, group)
    if rule.style == "vocab" and isinstance(module, nn.Embedding):
        return VocabParallelEmbedding(module, group, padded_vocab, sequence_parallel)
    if rule.style == "vocab" and isinstance(module, OutputLayer):
        return VocabParallelOutput(module, group, padded_vocab, sequence_parallel)
    raise TypeError(f"parallel plan: no {rule.style}-parallel version of {type(module).__name__}")


def check_tensor_parallel(config, tp: int) -> None:
    """One clear error when the model cannot be split over tp ranks (whole query groups and
    MLP columns per rank)."""
    if config.num_query_groups % tp:
        raise ParallelConfigError(
            f"num_query_groups (the model's key/value heads: num_key_value_heads, or its attention heads "
            f"without grouped-query attention)={config.num_query_groups} is not divisible by tensor parallel size {tp}; "
            f"use a tensor_model_parallel_size that divides {config.num_query_groups}")
    if config.ffn_hidden_size % tp:
        raise ParallelConfigError(f"ffn_hidden_size (intermediate_size)={config.ffn_hidden_size} is not divisible "
                                  f"by tensor parallel size {tp}")


def parallelize(model: nn.Module, plan: dict, group, sequence_parallel: bool = False) -> nn.Module:
    """Swap `model`'s modules for tensor-parallel ones over `group` (in place; returns model)."""
    tp = comm.group_size(group)
    check_tensor_parallel(model.config, tp)
    model.tp_group = group
    model.sequence_parallel = sequence_parallel and tp > 1
    if tp == 1:
        return model
    sp = model.sequence_parallel
    padded_vocab = model.config.padded_vocab_size(tp)
    for name, module in list(model.named_modules()):
        if not name:
            continue
        rule = module_rule(plan, name)
        if rule is not None:
            _swap(model, name, _parallel_module(module, rule, group, sp, padded_vocab))
        elif name.endswith("core_attention"):
            _swap(model, name, TPRNGFork(module))
        elif isinstance(module, VocabLoss):
            _swap(model, name, VocabParallelLoss(module.vocab_size, group))
        elif sp and isinstance(module, nn.Dropout):
            _swap(model, name, TPDropout(module.p))
        elif sp and name.endswith("position_embeddings"):
            module.register_forward_hook(lambda _m, _args, out: comm.sp_scatter(out, group))
        elif name.endswith(("self_attention.q_layernorm", "self_attention.k_layernorm")):
            for p in module.parameters():
                # not an SP param, but the same fix: this rank's heads give a partial grad, sum over TP
                p.sequence_parallel = True
        elif sp and isinstance(module, (nn.LayerNorm, RMSNorm)):
            for p in module.parameters():
                p.sequence_parallel = True  # grads from a sequence shard: all-reduce over TP
    return model
