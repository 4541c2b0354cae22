"""`hf_megatron.from_pretrained`: a transformers model (object, folder or Hub id) -> GPTModel.

Weights go through the same per-architecture mapping the converters use
(`hf_megatron.architectures`), then are sharded for this rank's TP/PP position.
"""
from __future__ import annotations

from typing import Any

import torch

from .architectures import hf_to_mcore
from .config import ModelConfig
from .model.gpt import GPTModel


def _source(name_or_path_or_model: Any):
    """(hf config dict, get(name) -> tensor) for a model object, a folder or a repo id."""
    if isinstance(name_or_path_or_model, torch.nn.Module) and hasattr(name_or_path_or_model, "config"):
        state_dict = name_or_path_or_model.state_dict()
        if getattr(name_or_path_or_model.config, "tie_word_embeddings", False):
            state_dict.pop("lm_head.weight", None)

        def get(name):
            try:
                return state_dict[name].detach()
            except KeyError:
                raise KeyError(f"the given model has no tensor {name!r}") from None

        return name_or_path_or_model.config.to_dict(), get
    from .conversion.hf_io import HFCheckpoint
    checkpoint = HFCheckpoint(name_or_path_or_model)
    return checkpoint.config, checkpoint.get


def from_pretrained(name_or_path_or_model: Any, *, dtype: torch.dtype | None = None, device=None,
                    **model_kwargs: Any) -> GPTModel:
    """Build a GPTModel with the pretrained weights of a transformers causal LM.

    `model_kwargs` go to GPTModel (`sequence_parallel`, `recompute`, `pre_process`,
    `post_process`, `layer_offset`, `num_layers`).  Call `hf_megatron.parallel.initialize`
    first for tensor/pipeline parallelism; each rank then loads only its shard.
    """
    hf_config, get = _source(name_or_path_or_model)
    config = ModelConfig.from_hf(hf_config)
    model = GPTModel(config, dtype=dtype, device=device, **model_kwargs)
    layers = range(model.layer_offset, model.layer_offset + model.num_layers)
    model.load_full_state_dict(dict(hf_to_mcore(get, config, layers)))
    return model
