"""Open any Megatron checkpoint folder as full megatron-core tensors, or load it into a model.

    ckpt = open_megatron(path)      # root with the tracker file, or an iter_*/release folder
    ckpt.config, ckpt.get(name)     # see reader.py

A folder with `.metadata` / `metadata.json` is torch_dist (`torch_dist.py`); otherwise
torch-format rank files (`mcore.py`).
"""
from __future__ import annotations

import os

from ..errors import CheckpointError
from ..parallel.sharding import load_full_weights
from .files import resolve_iteration_dir
from .mcore import MegatronCheckpoint
from .names import layer_index
from .reader import CheckpointReader
from .torch_dist import TorchDistCheckpoint


def open_megatron(path: str | os.PathLike, iteration: int | None = None,
                  vocab_size: int | None = None) -> CheckpointReader:
    """A reader for a torch-format or torch_dist Megatron checkpoint."""
    folder, it = resolve_iteration_dir(path, iteration)
    if (folder / ".metadata").is_file() or (folder / "metadata.json").is_file():
        return TorchDistCheckpoint(folder, it, vocab_size)
    return MegatronCheckpoint(folder, it, vocab_size)


def load_megatron_weights(model, path: str | os.PathLike, iteration: int | None = None) -> CheckpointReader:
    """Load a Megatron checkpoint of *any* TP/PP layout into `model` (this rank's GPTModel, any
    layout): the full tensors of the model's layers are read, then sharded for this rank.
    Weights only; for exact resume in the saved layout use training.checkpoint.load_checkpoint."""
    ckpt = open_megatron(path, iteration)
    ours, theirs = model.config, ckpt.config
    fields = ("model_type", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
              "ffn_hidden_size", "vocab_size")
    diff = [f"{f} {getattr(theirs, f)} (the model's: {getattr(ours, f)})" for f in fields
            if getattr(ours, f) != getattr(theirs, f)]
    if diff:
        raise CheckpointError(f"{ckpt.folder}: the checkpoint is of another model than the one built: "
                              f"{'; '.join(diff)}")
    layers = set(model.layer_numbers)
    wanted = [n for n in ckpt.names() if (i := layer_index(n)) is None or i in layers]
    load_full_weights(model, ((n, ckpt.get(n)) for n in wanted))
    return ckpt
