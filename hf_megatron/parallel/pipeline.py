"""Pipeline parallelism: GPTModel split into stages, run with 1F1B or interleaved 1F1B.

Stages.  With `pp` ranks and `vpp` virtual chunks per rank the model is cut into `pp * vpp`
model chunks of contiguous layers (even split, or an explicit per-chunk layer list); rank r
holds chunks r, r + pp, ..., r + (vpp - 1) * pp (Megatron's interleaved assignment).  Chunk 0
owns the embedding, the last chunk owns the final norm, output layer and loss.

Schedules come from `torch.distributed.pipelining`: `Schedule1F1B` (vpp = 1) and
`ScheduleInterleaved1F1B` (vpp > 1).  Each chunk is wrapped in a small adapter module
(`_StageModule`) because PipelineStage passes tensors, not our GPTOutput:

    first chunk:   input_ids          -> hidden [s, b, h]    ([s/tp, b, h] with sequence parallel)
    middle chunk:  hidden             -> hidden
    last chunk:    hidden             -> loss_sum (0-d)      and num_tokens kept on the side
    targets / position_ids / attention_mask reach every chunk as keyword arguments.

The schedule's loss function is `loss_sum * loss_scale`, and `scale_grads=False`, so the
gradient is exactly that of  sum_m loss_sum_m * loss_scale  (what one process computes).

How torch.distributed.pipelining is used (nothing blocked it; three things needed care):
* Stages are built in static mode (example input/output tensors given), so no shape-inference
  forward/backward runs: it would advance the dropout RNG streams and, under TP, issue extra
  collectives.  Stages and schedule are cached per (chunks, micro-batch shape, count) for
  training and for forward-only, and rebuilt when those change.
* The public `step()` takes one batch and splits it along dim 0 (the method that takes a list
  of micro batches is private and skips step()'s per-call setup), so the micro batches, which
  all have one shape, are concatenated and come back out unchanged.
* `Schedule1F1B` refuses fewer micro batches than stages; Megatron's 1F1B then does all
  forwards in its warm-up and all backwards in its cool-down, i.e. GPipe's order, so
  `ScheduleGPipe` runs that case.  Interleaving keeps Megatron's rule (micro batches a
  multiple of pp).

Tied embeddings with pp > 1: the last stage holds its own `output_layer` copy of the word
embedding; `allreduce_embedding_grads` sums the two gradients over the embedding group
(first and last pipeline rank of this tp/dp/cp position) so both copies take the same step.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import comm, state
from .sharding import stage_layers


# ----------------------------------------------------------------------------- splitting
def split_module(model: nn.Module, stage: int, num_stages: int, layers_per_stage: list[int] | None = None,
                 *, layers: str = "decoder.layers", first: tuple[str, ...] = ("embedding",),
                 last: tuple[str, ...] = ("decoder.final_layernorm", "output_layer", "vocab_loss")) -> nn.Module:
    """A copy of `model` holding only pipeline chunk `stage` of `num_stages` (torchtitan's idea).

    Knows no model, only names: `layers` is a ModuleDict of the blocks in order; chunk `stage`
    keeps its run of them (an even split or `layers_per_stage`); the modules in `first` stay on
    chunk 0 only and those in `last` on the last chunk only; removed modules become None, which
    the model's forward tolerates.  Meant for a model on the meta device (the copy is cheap);
    materialise the chunk afterwards."""
    blocks = list(model.get_submodule(layers).keys())
    held = stage_layers(len(blocks), num_stages, stage, layers_per_stage)
    keep = set(blocks[held.start:held.stop])
    part = copy.deepcopy(model)
    container = part.get_submodule(layers)
    for key in blocks:
        if key not in keep:
            del container[key]
    removed = (first if stage != 0 else ()) + (last if stage != num_stages - 1 else ())
    for name in removed:
        parent_name, _, leaf = name.rpartition(".")
        setattr(part.get_submodule(parent_name) if parent_name else part, leaf, None)
    return part


# ----------------------------------------------------------------------------- stages
class _StageModule(nn.Module):
    """Tensor-in / tensor-out view of one GPTModel chunk, as PipelineStage wants it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.num_tokens: list[torch.Tensor] = []  # last chunk: one count per micro batch
        self.loss_sums: list[torch.Tensor] = []

    def forward(self, first: torch.Tensor, targets: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        gpt = _unwrap(self.model)
        inputs = {"input_ids": first} if gpt.pre_process else {"hidden_states": first}
        # targets also give middle chunks the [b, s] shape
        out = self.model(targets=targets, return_logits=False, **inputs, **kwargs)
        if not gpt.post_process:
            return out.hidden_states
        self.loss_sums.append(out.loss_sum.detach())
        self.num_tokens.append(out.num_tokens)
        return out.loss_sum


def _activation_example(model: nn.Module, micro_batch: dict) -> torch.Tensor:
    """A tensor shaped like the [s, b, h] activation entering / leaving a middle chunk."""
    b, s = micro_batch["targets"].shape
    tp = comm.group_size(getattr(model, "tp_group", None))
    if getattr(model, "sequence_parallel", False):
        if s % tp:
            raise ValueError(f"sequence length {s} is not divisible by tp={tp} (sequence parallelism)")
        s //= tp
    param = next(model.parameters(), None)
    if param is None:  # a chunk without layers passes activations through unchanged
        dtype = getattr(model, "activation_dtype", torch.get_default_dtype())
        return torch.empty(s, b, model.config.hidden_size, dtype=dtype, device=micro_batch["targets"].device)
    return torch.empty(s, b, model.config.hidden_size, dtype=param.dtype, device=param.device)


def _loss_example(micro_batch: dict) -> torch.Tensor:
    return torch.zeros((), device=micro_batch["targets"].device)


_CACHE: dict = {}  # forward_only -> (key, schedule, stage modules, loss-scale cell): the last one of each


def _unwrap(model: nn.Module) -> nn.Module:
    """The GPTModel inside a DDP-style wrapper (which keeps it as `.module`)."""
    return getattr(model, "module", model)


def _schedule(chunks: list, micro_batches: list[dict], loss_scale: float, forward_only: bool):
    """(schedule, stage modules) for these chunks and micro-batch shapes."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                               ScheduleInterleaved1F1B)
    grid = state.get_state()
    pp, pp_rank, vpp = grid.pp, grid.coords["pp"], len(chunks)
    first = micro_batches[0]
    key = (tuple(id(c) for c in chunks), tuple(first["targets"].shape), len(micro_batches))
    cached = _CACHE.get(forward_only)
    if cached is not None and cached[0] == key:
        _, schedule, modules, scale = cached
        scale[0] = loss_scale
        return schedule, modules
    modules = [_StageModule(chunk) for chunk in chunks]
    chunks = [_unwrap(chunk) for chunk in chunks]
    stages = []
    for v, (chunk, module) in enumerate(zip(chunks, modules)):
        index = v * pp + pp_rank
        example_in = first["input_ids"] if chunk.pre_process else _activation_example(chunk, first)
        if not chunk.pre_process:
            example_in.requires_grad_(not forward_only)
        example_out = _loss_example(first) if chunk.post_process else _activation_example(chunk, first)
        example_out.requires_grad_(not forward_only)
        device = example_out.device
        stages.append(PipelineStage(module, index, pp * vpp, device, input_args=example_in,
                                    output_args=example_out, group=grid.group("pp")))
    scale = [loss_scale]  # a mutable cell: the cached schedule's loss_fn reads the current scale

    def scaled_loss(loss_sum: torch.Tensor, _target: Any) -> torch.Tensor:
        return loss_sum * scale[0]

    loss_fn = None if forward_only else scaled_loss
    if vpp > 1:
        schedule = ScheduleInterleaved1F1B(stages, len(micro_batches), loss_fn=loss_fn, scale_grads=False)
    elif len(micro_batches) < pp:
        # torch's 1F1B refuses fewer micro batches than stages; Megatron's 1F1B then runs every
        # forward in its warm-up and every backward in its cool-down, which is GPipe's order
        schedule = ScheduleGPipe(stages[0], len(micro_batches), loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = Schedule1F1B(stages[0], len(micro_batches), loss_fn=loss_fn, scale_grads=False)
    _CACHE[forward_only] = (key, schedule, modules, scale)
    return schedule, modules


# ----------------------------------------------------------------------------- running
def _check_micro_batches(micro_batches: list[dict], pp: int, vpp: int) -> None:
    if not micro_batches:
        raise ValueError("forward_backward needs at least one micro batch")
    for i, mb in enumerate(micro_batches):
        for key in ("input_ids", "targets"):
            if key not in mb:
                raise ValueError(f"micro batch {i} has no {key!r} (expected keys input_ids, targets (aligned: "
                                 f"token t is scored against targets[t]), optional attention_mask, position_ids)")
        if mb["input_ids"].shape != mb["targets"].shape:
            raise ValueError(f"micro batch {i}: input_ids {tuple(mb['input_ids'].shape)} and targets "
                             f"{tuple(mb['targets'].shape)} differ in shape")
        for key in OPTIONAL_KEYS:
            if (mb.get(key) is None) != (micro_batches[0].get(key) is None):
                raise ValueError(f"micro batch {i}: {key!r} must be given in every micro batch or in none")
        if mb["targets"].shape != micro_batches[0]["targets"].shape:
            raise ValueError(f"micro batch {i} has shape {tuple(mb['targets'].shape)}, expected "
                             f"{tuple(micro_batches[0]['targets'].shape)} like micro batch 0")
    if vpp > 1 and len(micro_batches) % pp:
        raise ValueError(f"interleaved pipeline schedule needs the number of micro batches "
                         f"({len(micro_batches)}) to be a multiple of the pipeline size ({pp})")


OPTIONAL_KEYS = ("attention_mask", "position_ids")


def _extra_kwargs(mb: dict) -> dict:
    """Optional model inputs, shaped [b, s] (a broadcast [1, s] position_ids is expanded)."""
    shape = mb["targets"].shape
    return {key: mb[key].expand(shape) for key in OPTIONAL_KEYS if mb.get(key) is not None}


def _plain_loop(model, micro_batches, loss_scale, forward_only):
    # the sums start from the first micro batch's values, on their device: a host zero copied to the
    # GPU would be a blocking copy, a wait for the whole backward just queued
    loss_sum = num_tokens = None
    for mb in micro_batches:
        with torch.set_grad_enabled(not forward_only and torch.is_grad_enabled()):
            out = model(mb["input_ids"], targets=mb["targets"], return_logits=False, **_extra_kwargs(mb))
        if not forward_only:
            (out.loss_sum * loss_scale).backward()
        part_loss, part_tokens = out.loss_sum.detach().float(), out.num_tokens.long()
        loss_sum = part_loss if loss_sum is None else loss_sum + part_loss
        num_tokens = part_tokens if num_tokens is None else num_tokens + part_tokens
    if loss_sum is None:  # no micro batches
        loss_sum, num_tokens = torch.zeros((), dtype=torch.float32), torch.zeros((), dtype=torch.long)
    return {"loss_sum": loss_sum, "num_tokens": num_tokens}


def forward_backward(chunks: list, micro_batches: list[dict], *, loss_scale: float = 1.0,
                     forward_only: bool = False) -> dict[str, torch.Tensor]:
    """Forward (and backward of loss_sum * loss_scale) of every micro batch through the pipeline.

    Returns {"loss_sum", "num_tokens"} summed over micro batches, on every pipeline rank.
    Gradients accumulate into .grad (call zero_grad yourself)."""
    grid = state.get_state()
    pp, vpp = grid.pp, len(chunks)
    _check_micro_batches(micro_batches, pp, vpp)
    if pp == 1:
        if vpp != 1:
            raise ValueError(f"virtual pipeline chunks ({vpp}) need pipeline size > 1")
        return _plain_loop(chunks[0], micro_batches, loss_scale, forward_only)

    schedule, modules = _schedule(chunks, micro_batches, loss_scale, forward_only)
    for module in modules:
        module.loss_sums.clear(), module.num_tokens.clear()
    # step() splits one batch along dim 0 into equal micro batches: concatenating ours (all of
    # one shape) gives them back unchanged
    extras = [_extra_kwargs(mb) for mb in micro_batches]
    batch = {"input_ids": torch.cat([mb["input_ids"] for mb in micro_batches]),
             "targets": torch.cat([mb["targets"] for mb in micro_batches]),
             **{key: torch.cat([extra[key] for extra in extras]) for key in extras[0]}}
    input_ids = batch.pop("input_ids")
    if forward_only:
        with torch.no_grad():
            schedule.step(input_ids, return_outputs=False, **batch)
    else:
        schedule.step(input_ids, target=batch["targets"], return_outputs=False, **batch)

    device = micro_batches[0]["targets"].device
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    last = modules[-1]
    if _unwrap(last.model).post_process:
        totals[0] = torch.stack([x.double() for x in last.loss_sums]).sum()
        totals[1] = torch.stack(last.num_tokens).sum()
    last.loss_sums.clear(), last.num_tokens.clear()
    # only the last stage holds them: a sum over the pp group is a broadcast
    dist.all_reduce(totals, group=grid.group("pp"))
    return {"loss_sum": totals[0].float(), "num_tokens": totals[1].long()}


# ----------------------------------------------------------------------------- tied embeddings
def tied_embedding_params(chunks: list) -> list:
    """This rank's copies of a word embedding tied across pipeline stages (first stage: the
    embedding, last stage: the output layer); [] without pp > 1 and tied embeddings."""
    grid = state.get_state()
    chunks = [_unwrap(chunk) for chunk in chunks]
    if grid.pp == 1 or not chunks[0].config.tie_word_embeddings or grid.group("embd") is None:
        return []  # (no embedding group: a middle stage)
    params = []
    if chunks[0].pre_process:
        params.append(chunks[0].embedding.word_embeddings.weight)
    if chunks[-1].post_process:
        params.append(chunks[-1].output_layer.weight)
    return params


def allreduce_embedding_grads(chunks: list) -> None:
    """Sum the word-embedding gradient (first stage) and its output-layer copy's (last stage):
    `.main_grad` where the mixed-precision optimizer keeps fp32 gradients, else `.grad`.

    y = x_out W^T on the last stage and e = W[ids] on the first use one matrix W in the tied
    model, so dL/dW = dL/dW_first + dL/dW_last; after the all-reduce both copies hold it."""
    group = state.get_state().group("embd")
    for param in tied_embedding_params(chunks):
        if getattr(param, "main_grad", None) is not None:  # mixed precision: fp32 accumulator
            dist.all_reduce(param.main_grad, group=group)
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, group=group)
