"""Names and shapes of a model's weights, megatron-core's (`checkpoint.shapes.full_shapes`) and
HF's (the same, through the family's mapping run on meta tensors).  How they split over TP/PP
ranks is `hf_megatron.parallel.sharding`; stage-local names are `hf_megatron.checkpoint.names`."""
from __future__ import annotations

from typing import Iterator

import torch

from ..architectures import mcore_to_hf
from ..checkpoint.shapes import full_shapes
from ..config import ModelConfig

__all__ = ["full_shapes", "hf_meta_tensors", "hf_shapes"]


def hf_meta_tensors(config: ModelConfig, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of a model as meta tensors (names, shapes, dtype; no memory), in mapping order."""
    shapes = full_shapes(config, padded_vocab=False)
    return mcore_to_hf(lambda n: torch.empty(shapes[n], dtype=dtype, device="meta"), config)


def hf_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    """HF name -> shape of every weight the config's model has."""
    return {name: tensor.shape for name, tensor in hf_meta_tensors(config)}
