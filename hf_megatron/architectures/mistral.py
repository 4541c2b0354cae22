"""Mistral: Llama's weights and config, plus a sliding attention window."""
from __future__ import annotations

from typing import Any

from .base import Architecture
from .llama import WEIGHTS, llama_like_fields


def _fields(data: dict[str, Any]) -> dict[str, Any]:
    return {**llama_like_fields(data), "sliding_window": data.get("sliding_window")}


# Megatron-LM flags of a Mistral checkpoint read as Llama (the window is not recognised), as before
MISTRAL = Architecture("mistral", ("MistralForCausalLM",), _fields, WEIGHTS)
