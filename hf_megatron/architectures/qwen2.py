"""Qwen2: Llama's weights with a bias on q, k and v only (none on o_proj)."""
from __future__ import annotations

from typing import Any

from ..config import ConfigError
from .base import Architecture, MegatronArgs
from .llama import WEIGHTS, is_llama_like, llama_like_fields, llama_like_hf_config


def _fields(data: dict[str, Any]) -> dict[str, Any]:
    fields = {**llama_like_fields(data), "add_qkv_bias": True, "add_proj_bias": False}
    if data.get("use_sliding_window"):
        raise ConfigError("qwen2 with use_sliding_window=True is not supported")
    return fields


def _from_megatron_args(args: MegatronArgs) -> dict[str, Any] | None:
    if is_llama_like(args) and args.qkv_bias and not args.bias_linear:
        return llama_like_hf_config(args)
    return None


QWEN2 = Architecture("qwen2", ("Qwen2ForCausalLM",), _fields, WEIGHTS, from_megatron_args=_from_megatron_args)
