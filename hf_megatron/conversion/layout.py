"""Names and shapes of a model's full megatron-core weights (from a meta-device model).  How
they split over TP/PP ranks is `hf_megatron.parallel.sharding`; stage-local names are
`hf_megatron.checkpoint.names`."""
from __future__ import annotations

import torch

from ..config import ModelConfig
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
