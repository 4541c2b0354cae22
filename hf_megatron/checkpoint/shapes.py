"""The shapes a model's weights must have, and the one check every reader runs against them.

`full_shapes(config)` are the full (single-process) megatron-core shapes, from a meta-device
GPTModel: no memory, and the same modules training builds, so a checkpoint that passes the
check loads.  A reader compares what each file stores (rank-file shards, torch_dist entries,
safetensors headers) before any tensor is read, and reports the first mismatch as one line:

    <file>: tensor 'decoder.layers.0.mlp.linear_fc1.weight' has shape (256, 64), expected (512, 64) ...

A tensor the config expects but no file holds is an error too (never dropped), and so is a
tensor of a non-floating dtype (every weight of these models is floating point).
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..errors import CheckpointError
from ..model.gpt import GPTModel
from ..parallel.sharding import VOCAB_PARAMS


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


def describe(config: ModelConfig) -> str:
    """The config facts shapes follow from, for the error line."""
    return (f"{config.model_type}: {config.num_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_attention_heads} heads / {config.num_query_groups} groups of {config.kv_channels}, "
            f"ffn {config.ffn_hidden_size}, vocab {config.vocab_size}")


def check_tensor(file, name: str, shape, dtype: torch.dtype, expected, config: ModelConfig,
                 source: str = "the config") -> None:
    """One stored tensor against its expected shape (None: the config has no such tensor)."""
    if expected is None:
        raise CheckpointError(f"{file}: tensor {name!r} is not part of the model {source} describes "
                              f"({describe(config)})")
    if tuple(shape) != tuple(expected):
        raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(shape)}, expected {tuple(expected)} "
                              f"from {source} ({describe(config)})")
    if not dtype.is_floating_point:
        raise CheckpointError(f"{file}: tensor {name!r} has dtype {str(dtype).replace('torch.', '')}, "
                              f"expected a floating-point weight")


def check_missing(folder, present, expected: dict, config: ModelConfig, source: str = "the config") -> None:
    """Every expected tensor must be held somewhere: the first missing one is an error."""
    missing = [name for name in expected if name not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{folder}: tensor {missing[0]!r}{more} missing; {source} "
                              f"({describe(config)}) needs it, shape {tuple(expected[missing[0]])}")
