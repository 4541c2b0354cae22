"""megatron-core parameter names: layer numbers, global <-> stage-local, model-chunk keys.

A full model names its layers 0..L-1 (`decoder.layers.7.mlp.linear_fc1.weight`); a rank file
numbers the layers of its pipeline chunk from 0, as Megatron writes them.  A rank file holds
one chunk as `model`, or virtual-pipeline chunks as `model0`, `model1`, ...
"""
from __future__ import annotations

import re

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")  # (layer number, rest of the name)
_MODEL_KEY = re.compile(r"model\d*")


def layer_index(name: str) -> int | None:
    """The layer number in a `decoder.layers.N.*` name; None for embedding, final norm, output."""
    match = LAYER.match(name)
    return int(match.group(1)) if match else None


def to_local_name(name: str, offset: int, count: int) -> str | None:
    """Global -> stage-local layer name, or None if the layer is not in [offset, offset + count)."""
    match = LAYER.match(name)
    if not match:
        return name
    index = int(match.group(1)) - offset
    return f"decoder.layers.{index}.{match.group(2)}" if 0 <= index < count else None


def to_global_name(name: str, offset: int) -> str:
    match = LAYER.match(name)
    return f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}" if match else name


def to_stage_local(state: dict, layers) -> dict:
    """A chunk's state dict, whose model holds global layers `layers`, with the layer numbers
    local to the chunk (as Megatron writes rank files)."""
    offset = min(layers, default=0)
    return {to_local_name(name, offset, len(layers)): t for name, t in state.items()}


def to_stage_global(state: dict, layers) -> dict:
    """A rank file's chunk state dict back to the global numbers of the model's `layers`."""
    offset = min(layers, default=0)
    return {to_global_name(name, offset): t for name, t in state.items()}


def model_keys(chunks: int) -> list[str]:
    """The rank-file keys of `chunks` model chunks: ["model"] or ["model0", "model1", ...]."""
    return ["model"] if chunks == 1 else [f"model{i}" for i in range(chunks)]


def chunk_keys(payload: dict) -> list[str]:
    """The model-chunk keys a rank file holds, in chunk order."""
    return sorted((k for k in payload if isinstance(k, str) and _MODEL_KEY.fullmatch(k)), key=lambda k: int(k[5:] or 0))
