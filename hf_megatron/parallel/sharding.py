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

import torch

from ..architectures import plan_for
from ..architectures.plan import param_rule
from ..errors import ParallelConfigError

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def split_rule(name: str, config) -> tuple[str, int | None, int]:
    """(style, dim, parts) of a full-model parameter name under config's plan."""
    return param_rule(plan_for(config), name)


def pad_vocab(tensor: torch.Tensor, padded_rows: int) -> torch.Tensor:
    if tensor.shape[0] >= padded_rows:
        return tensor[:padded_rows]
    pad = tensor.new_zeros((padded_rows - tensor.shape[0],) + tuple(tensor.shape[1:]))
    return torch.cat([tensor, pad])


def split_tensor(name: str, tensor: torch.Tensor, config, tp: int) -> list[torch.Tensor]:
    """Full tensor -> its tp shards, in TP-rank order."""
    style, dim, parts = split_rule(name, config)
    if style == "replicated" or (tp == 1 and style != "vocab"):
        return [tensor] * tp
    if style == "vocab":
        tensor = pad_vocab(tensor, config.padded_vocab_size(tp))
    pieces = tensor.chunk(parts, dim=dim) if parts > 1 else (tensor,)
    for piece in pieces:
        if piece.shape[dim] % tp:
            raise ParallelConfigError(f"{name}: dim {dim} of size {piece.shape[dim]} is not divisible by "
                                      f"tensor_model_parallel_size={tp}")
    per_piece = [piece.chunk(tp, dim=dim) for piece in pieces]
    return [torch.cat([chunks[r] for chunks in per_piece], dim=dim).contiguous() if parts > 1
            else per_piece[0][r].contiguous() for r in range(tp)]


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
