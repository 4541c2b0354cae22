"""Tensor/pipeline-parallel layout of megatron-core weights: split full tensors, merge shards.

Rules (megatron-core's):
* vocab tables (`embedding.word_embeddings.weight`, `output_layer.weight`): zero-padded to
  `config.padded_vocab_size(tp)` rows, then split on dim 0;
* column-parallel (`linear_qkv`, `linear_fc1` weight and bias): split on dim 0 -- for the
  fused QKV a contiguous block of query groups per rank; for SwiGLU fc1 the gate and up
  halves are split separately and each rank holds [gate_r; up_r];
* row-parallel weights (`linear_proj`, `linear_fc2`): split on dim 1; their biases, norms and
  position embeddings are replicated.
Pipeline stages hold a contiguous run of layers, renumbered from 0 (as Megatron writes them).
"""
from __future__ import annotations

import math
import re

import torch

from ..config import ModelConfig

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def split_rule(name: str, config: ModelConfig) -> tuple[str, int | None]:
    """('vocab' | 'column' | 'gated' | 'row' | 'replicated', dim)."""
    if name in VOCAB_PARAMS:
        return "vocab", 0
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return "column", 0
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return ("gated", 0) if config.gated_mlp else ("column", 0)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row", 1
    return "replicated", None


def pad_vocab(tensor: torch.Tensor, padded_rows: int) -> torch.Tensor:
    if tensor.shape[0] >= padded_rows:
        return tensor[:padded_rows]
    pad = tensor.new_zeros((padded_rows - tensor.shape[0],) + tuple(tensor.shape[1:]))
    return torch.cat([tensor, pad])


def split_tensor(name: str, tensor: torch.Tensor, config: ModelConfig, tp: int) -> list[torch.Tensor]:
    """Full tensor -> the tp shards, in TP-rank order."""
    rule, dim = split_rule(name, config)
    if rule == "replicated" or tp == 1 and rule != "vocab":
        return [tensor] * tp
    if rule == "vocab":
        tensor = pad_vocab(tensor, config.padded_vocab_size(tp))
    if rule == "gated":
        gate, up = tensor.chunk(2, dim=0)
        return [torch.cat([g, u]).contiguous() for g, u in zip(gate.chunk(tp, 0), up.chunk(tp, 0))]
    if tensor.shape[dim] % tp:
        raise ValueError(f"{name}: dim {dim} of size {tensor.shape[dim]} is not divisible by tp={tp}")
    return [t.contiguous() for t in tensor.chunk(tp, dim=dim)]


def merge_tensor(name: str, shards: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """The tp shards -> the full tensor (vocab padding removed)."""
    rule, dim = split_rule(name, config)
    if rule == "replicated":
        return shards[0]
    if rule == "gated":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    full = torch.cat(shards, dim=dim) if len(shards) > 1 else shards[0]
    return full[: config.vocab_size] if rule == "vocab" else full


def stage_layers(num_layers: int, pp: int, stage: int, layers_per_stage: list[int] | None = None) -> range:
    """Global layer numbers held by pipeline `stage` (even split, or an explicit list)."""
    if layers_per_stage is None:
        if num_layers % pp:
            raise ValueError(f"num_layers={num_layers} is not divisible by pipeline size {pp}; "
                             f"pass an explicit per-stage layer list")
        layers_per_stage = [num_layers // pp] * pp
    if len(layers_per_stage) != pp or sum(layers_per_stage) != num_layers:
        raise ValueError(f"per-stage layer list {layers_per_stage} must have {pp} entries summing to {num_layers}")
    start = sum(layers_per_stage[:stage])
    return range(start, start + layers_per_stage[stage])


def to_local_name(name: str, offset: int, count: int) -> str | None:
    """Global -> stage-local layer name, or None if the layer is not on this stage."""
    match = _LAYER.match(name)
    if not match:
        return name
    index = int(match.group(1)) - offset
    return f"decoder.layers.{index}.{match.group(2)}" if 0 <= index < count else None


def to_global_name(name: str, offset: int) -> str:
    match = _LAYER.match(name)
    return f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}" if match else name


def shard_for_model(full: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """The local state dict of `model` (a GPTModel on this rank) from full weights."""
    from ..parallel import state
    tp, rank = state.tp_size(), state.tp_rank()
    config = model.config
    full = dict(full)
    if config.tie_word_embeddings and "output_layer.weight" not in full and "embedding.word_embeddings.weight" in full:
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    wanted = set(model.state_dict().keys())
    local = {}
    for name, tensor in full.items():
        local_name = to_local_name(name, model.layer_offset, model.num_layers)
        if local_name is None or local_name not in wanted:
            continue
        local[local_name] = split_tensor(name, tensor, config, tp)[rank]
    return local


def full_shapes(config: ModelConfig, padded_vocab: bool = True) -> dict[str, torch.Size]:
    """Names and shapes of the full (single-process) megatron-core weights; vocab rows padded
    (as a tp=1 model holds them) or not."""
    from ..model.gpt import GPTModel  # a meta-device model gives the names and shapes
    from ..parallel import state
    saved = state.get_state()
    state.reset()
    try:
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in GPTModel(config).state_dict().items()}
    finally:
        state.set_state(saved)
    if not padded_vocab:
        for name in VOCAB_PARAMS:
            if name in shapes:
                shapes[name] = torch.Size((config.vocab_size,) + tuple(shapes[name][1:]))
    return shapes


def random_full_state_dict(config: ModelConfig, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Megatron-style initial weights at full size: normal(0, std) for matrices and embeddings,
    output projections (linear_proj, linear_fc2) with std / sqrt(2 * num_layers), zero biases,
    unit norm weights.  Same seed -> same weights in every parallel layout."""
    shapes = full_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    std, scaled = config.init_method_std, config.init_method_std / math.sqrt(2.0 * config.num_layers)
    full = {}
    for name, shape in shapes.items():
        if name.endswith("bias"):
            full[name] = torch.zeros(shape)
        elif "layernorm" in name:
            full[name] = torch.ones(shape)
        else:
            sigma = scaled if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
            full[name] = torch.randn(shape, generator=gen) * sigma
            if name in VOCAB_PARAMS:
                full[name] = full[name][: config.vocab_size]
    return full
