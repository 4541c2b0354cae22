"""Activation recompute applied from outside (Megatron's `--recompute-granularity`).

* "selective": only core attention (softmax(q k^T) v, the part whose activations grow with s^2)
  is recomputed in backward;
* "full": every transformer layer is recomputed from its input.

The module's forward is replaced on the instance, so parameter names do not change.  The
recompute replays the tensor-parallel dropout stream (`random.replayable`): torch's checkpoint
restores the default generator only.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .compile import compile_scope
from .random import replayable

GRANULARITIES = (None, "full", "selective")


def _checkpointed(module: nn.Module) -> None:
    forward = module.forward

    @functools.wraps(forward)
    def run(*args):
        if module.training and torch.is_grad_enabled():
            return checkpoint(replayable(forward), *args, use_reentrant=False)
        return forward(*args)

    run.hf_megatron_recompute = True  # parallel/compile.py refuses a decoder region around it
    module.forward = run


def apply_recompute(model: nn.Module, granularity: str | None) -> nn.Module:
    if granularity not in GRANULARITIES:
        raise ValueError(f"recompute granularity must be None, 'full' or 'selective', got {granularity!r}")
    if granularity is None:
        return model
    if compile_scope(model) == "decoder":
        raise ValueError("activation recompute cannot be applied inside a decoder compiled as one region "
                         "(its checkpoints would be traced there); compile per layer to recompute")
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if granularity == "selective" and leaf == "core_attention":
            _checkpointed(module)
        elif granularity == "full" and name.startswith("decoder.layers.") and name.count(".") == 2:
            _checkpointed(module)
    return model
