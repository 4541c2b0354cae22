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

import re

import torch

from ..config import ModelConfig
from ..model.gpt import GPTModel

from ..parallel.sharding import VOCAB_PARAMS, merge_tensor, pad_vocab, split_rule, split_tensor, stage_layers  # noqa: F401

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


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


def full_shapes(config: ModelConfig, padded_vocab: bool = True) -> dict[str, torch.Size]:
    """Names and shapes of the full (single-process) megatron-core weights; vocab rows padded
    (as a tp=1 model holds them) or not."""
    with torch.device("meta"):  # a meta-device model gives the names and shapes, no memory
        shapes = {k: v.shape for k, v in GPTModel(config).state_dict().items()}
    if not padded_vocab:
        for name in VOCAB_PARAMS:
            if name in shapes:
                shapes[name] = torch.Size((config.vocab_size,) + tuple(shapes[name][1:]))
    return shapes
