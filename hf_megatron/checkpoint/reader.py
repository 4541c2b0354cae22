"""What every checkpoint reader offers: full megatron-core tensors by global name.

    ckpt.config          ModelConfig (from args.hf_config, or recognised from Megatron's flags)
    ckpt.args            the saved args namespace;  ckpt.info: the other non-tensor entries
    ckpt.iteration, ckpt.tp, ckpt.pp
    ckpt.names()         full megatron-core names, global layer numbers
    ckpt.get(name)       one full tensor (TP shards merged, vocab padding removed)

`where` maps each full name to wherever the reader finds it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CheckpointError
from .args import config_from_args
from .shapes import check_missing, check_tensor, full_shapes

ARGS = "the checkpoint's args"
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")  # weights of the model; anything else is a buffer

NOT_INFO = ("model", "optimizer", "opt_param_scheduler", "rng_state")  # entries that are not run facts


def info_entries(payload: dict) -> dict:
    """A rank file's entries other than model chunks, optimizer, scheduler and RNG state."""
    return {k: v for k, v in payload.items() if not (isinstance(k, str) and k.startswith(NOT_INFO))}


def config_of(args, vocab_size, where) -> "ModelConfig":
    """The ModelConfig of a checkpoint's args; what we cannot use is an error naming `where`."""
    from ..errors import ConfigError
    try:
        return config_from_args(args, vocab_size)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def checkpoint_version(value, where) -> float:
    """Megatron's `checkpoint_version` entry (0 when absent) as a number."""
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        raise CheckpointError(f"{where}: checkpoint_version {value!r} is not a number") from None


def vocab_rows_ok(rows: int, config) -> bool:
    """A stored vocab table's row count: the vocabulary itself, or padded past it to a multiple of
    make_vocab_size_divisible_by (Megatron pads to a multiple of that times tp)."""
    return rows == config.vocab_size or (rows > config.vocab_size and rows % config.make_vocab_size_divisible_by == 0)


class CheckpointReader:
    folder: Path
    where: dict

    def names(self) -> list[str]:
        return list(self.where)

    def locate(self, name: str):
        try:
            return self.where[name]
        except KeyError:
            raise CheckpointError(f"{self.folder}: tensor {name!r} not found (wrong architecture for this checkpoint?)") from None

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def expected_shapes(self) -> dict[str, torch.Size]:
        """Full shape (unpadded vocab) of every weight the config's model has, by global name;
        `where` loses entries that are no model weight (buffers such as `rotary_pos_emb.inv_freq`,
        recomputed at build).  A missing weight, or a model-named tensor the config has no place
        for, is an error naming it."""
        expected = full_shapes(self.config, padded_vocab=False)
        for name in [n for n in self.where if not n.startswith(MODEL_PREFIXES)]:
            del self.where[name]
        check_missing(self.folder, self.where, expected, self.config, ARGS)
        if self.config.tie_word_embeddings and "output_layer.weight" in self.where:
            # Megatron keeps a copy of the tied table on the last stage
            expected = {**expected, "output_layer.weight": expected["embedding.word_embeddings.weight"]}
        for name in self.where:
            if name not in expected:
                check_tensor(self.folder, name, (), torch.float32, None, self.config, ARGS)
        return expected

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: self.get(name) for name in self.names()}
