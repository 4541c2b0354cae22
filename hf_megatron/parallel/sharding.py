"""Split full megatron-core tensors into tensor/pipeline-parallel shards and merge them back.

The rules come from the architecture's parallel plan (`hf_megatron.architectures.plan`), the
same table that makes the tensor-parallel modules, so a rank's tensors always have the shapes
its modules expect:

    vocab       rows zero-padded to `config.padded_vocab_size(tp)`, then split on dim 0
    column      split on dim 0; with `parts` > 1 each part is split separately and rank r holds
                [part_1,r; ...; part_k,r] (SwiGLU fc1: [gate_r; up_r])
    row         weights split on dim 1 (their biases are replicated)
    replicated  every rank holds the whole tensor

Pipeline stages hold a contiguous run of layers (`stage_layers`): an even split, or an explicit
per-stage list; Megatron writes their numbers local to the stage.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..architectures import plan_for
from ..architectures.plan import param_rule
from ..errors import CheckpointError, ParallelConfigError
from . import comm

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def split_rule(name: str, config) -> tuple[str, int | None, int]:
    """(style, dim, parts) of a full-model parameter name under config's plan."""
    return param_rule(plan_for(config), name)


def pad_vocab(tensor: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """A vocab table with `padded_rows` rows: zero rows added, or surplus padding rows dropped."""
    if tensor.shape[0] >= padded_rows:
        return tensor[:padded_rows]
    pad = tensor.new_zeros((padded_rows - tensor.shape[0],) + tuple(tensor.shape[1:]))
    return torch.cat([tensor, pad])


def shard_tensor(tensor: torch.Tensor, style: str, dim: int | None, parts: int, tp: int) -> list[torch.Tensor]:
    """A (vocab-padded) full tensor -> its tp shards under one rule (see the module docstring)."""
    if style == "replicated" or tp == 1:
        return [tensor] * tp
    pieces = tensor.chunk(parts, dim=dim) if parts > 1 else (tensor,)
    for piece in pieces:
        if piece.shape[dim] % tp:
            raise ParallelConfigError(f"a {style}-parallel tensor of shape {tuple(tensor.shape)}: dim {dim} "
                                      f"({piece.shape[dim]} per part) is not divisible by tensor_model_parallel_size={tp}")
    per_piece = [piece.chunk(tp, dim=dim) for piece in pieces]
    if parts == 1:
        return [chunk.contiguous() for chunk in per_piece[0]]
    return [torch.cat([chunks[r] for chunks in per_piece], dim=dim).contiguous() for r in range(tp)]


def split_tensor(name: str, tensor: torch.Tensor, config, tp: int) -> list[torch.Tensor]:
    """Full tensor -> its tp shards, in TP-rank order."""
    style, dim, parts = split_rule(name, config)
    if style == "vocab":
        tensor = pad_vocab(tensor, config.padded_vocab_size(tp))
    try:
        return shard_tensor(tensor, style, dim, parts, tp)
    except ParallelConfigError as exc:
        raise ParallelConfigError(f"{name}: {exc}") from None


def merge_tensor(name: str, shards: list[torch.Tensor], config) -> torch.Tensor:
    """The tp shards -> the full tensor (vocab padding removed)."""
    style, dim, parts = split_rule(name, config)
    if style == "replicated":
        return shards[0]
    if parts > 1:
        split = [s.chunk(parts, dim=dim) for s in shards]
        return torch.cat([split[r][p] for p in range(parts) for r in range(len(shards))], dim=dim)
    full = torch.cat(shards, dim=dim) if len(shards) > 1 else shards[0]
    return full[: config.vocab_size] if style == "vocab" else full


def layers_per_stage_list(num_layers: int, stages: int, layers_per_stage: list[int] | None = None) -> list[int]:
    """How many layers each of `stages` pipeline chunks holds (even split, or the explicit list checked)."""
    if layers_per_stage is None:
        if num_layers % stages:
            raise ParallelConfigError(f"num_layers={num_layers} is not divisible by {stages} pipeline chunks; "
                                      f"pass an explicit per-stage layer list")
        return [num_layers // stages] * stages
    if len(layers_per_stage) != stages or sum(layers_per_stage) != num_layers or min(layers_per_stage) < 0:
        raise ParallelConfigError(f"per-stage layer list {layers_per_stage} must have {stages} non-negative "
                                  f"entries summing to num_layers={num_layers}")
    return list(layers_per_stage)


def stage_layers(num_layers: int, stages: int, stage: int, layers_per_stage: list[int] | None = None) -> range:
    """Global layer numbers held by pipeline chunk `stage` of `stages`."""
    counts = layers_per_stage_list(num_layers, stages, layers_per_stage)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def load_full_weights(model: nn.Module, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Fill `model` (a chunk, possibly tensor-parallel) from full megatron-core tensors (global
    layer numbers, unpadded vocab); tensors the chunk does not hold are skipped.  Every
    parameter must be filled (one-line error naming the first missing ones)."""
    config, group = model.config, getattr(model, "tp_group", None)
    tp, rank = comm.group_size(group), comm.group_rank(group)
    params = dict(model.named_parameters())
    tied_copy = model.output_layer is not None and model.embedding is None and config.tie_word_embeddings
    filled = set()
    for name, tensor in pairs:
        if tied_copy and name == "embedding.word_embeddings.weight":
            name = "output_layer.weight"  # the last stage's copy of the tied table
        param = params.get(name)
        if param is None:
            continue
        shard = split_tensor(name, tensor, config, tp)[rank]
        if tuple(shard.shape) != tuple(param.shape):
            raise CheckpointError(f"{name}: shape {tuple(tensor.shape)} does not fit the model "
                                  f"(this rank expects {tuple(param.shape)} of it)")
        with torch.no_grad():
            param.copy_(shard)
        filled.add(name)
    missing = [n for n in params if n not in filled]
    if missing:
        raise CheckpointError(f"weights do not cover the model: missing {missing[:5]}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
