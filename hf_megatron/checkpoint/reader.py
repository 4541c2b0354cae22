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

NOT_INFO = ("model", "optimizer", "opt_param_scheduler", "rng_state")  # entries that are not run facts


def info_entries(payload: dict) -> dict:
    """A rank file's entries other than model chunks, optimizer, scheduler and RNG state."""
    return {k: v for k, v in payload.items() if not (isinstance(k, str) and k.startswith(NOT_INFO))}


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

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: self.get(name) for name in self.names()}
