"""Write a Hugging Face folder as `save_pretrained` does, streaming one tensor at a time.

Output: `model.safetensors` or `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`
(shards planned by huggingface_hub's `split_torch_state_dict_into_shards`), `config.json`,
`generation_config.json` and the tokenizer files.

Streaming: the shard plan is made from *meta* tensors (the mapping run on shapes only); then
the real mapping yields HF tensors one by one into the pending shard, which is written and
freed as soon as its last tensor arrives.  huggingface_hub fills shards in order, so at most
one shard (plus one tensor being produced) is in memory.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from ..architectures import hf_class_name, mcore_to_hf
from ..checkpoint.files import copy_files_within, honour_umask
from ..config import ModelConfig
from .hf_io import TOKENIZER_FILES, link_root
from .layout import hf_meta_tensors

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def write_hf_config(out_dir: Path, config: ModelConfig, dtype: torch.dtype, generation_config: dict | None) -> None:
    from transformers import CONFIG_MAPPING, GenerationConfig
    data = dict(config.hf_config)
    data.setdefault("architectures", [hf_class_name(config.model_type)])
    hf_config = CONFIG_MAPPING[config.model_type].from_dict(data)
    hf_config.dtype = dtype
    hf_config.save_pretrained(out_dir)
    gen = GenerationConfig.from_dict(generation_config) if generation_config else \
        GenerationConfig.from_model_config(hf_config)
    gen.save_pretrained(out_dir)


def copy_tokenizer(source: Path | None, out_dir: Path) -> list[str]:
    if source is None or not source.is_dir():
        return []
    return copy_files_within(source, out_dir, TOKENIZER_FILES, root=link_root(source))


def write_hf_weights(out_dir: Path, config: ModelConfig, get_mcore: Callable[[str], torch.Tensor],
                     dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB") -> dict:
    """Map megatron-core tensors (`get_mcore(full_name)`) to HF names and write safetensors shards."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    plan = split_torch_state_dict_into_shards(dict(hf_meta_tensors(config, dtype or torch.float32)),
                                              max_shard_size=max_shard_size)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in mcore_to_hf(get_mcore, config):
        file = plan.tensor_to_filename[name]
        tensor = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        pending.setdefault(file, {})[name] = tensor.contiguous()
        if len(pending[file]) == len(plan.filename_to_tensors[file]):
            save_file(pending.pop(file), str(out_dir / file), metadata={"format": "pt"})
            honour_umask(out_dir / file)  # safetensors creates its files 0600
    if pending:
        raise RuntimeError(f"internal error: shards {sorted(pending)} were never completed")
    if plan.is_sharded:
        index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return {"files": sorted(plan.filename_to_tensors), "total_size": plan.metadata.get("total_size")}
