"""Gemma 3 (text, `gemma3_text` / Gemma3ForCausalLM): Gemma 2's layer with per-head q/k norms and
two RoPE settings, one for sliding-window layers and one for full-attention layers.

    q_h = norm_q(W_q,h x), k_g = norm_k(W_k,g x)   over head_dim, (1 + w) RMSNorm, before RoPE
    sliding layers: RoPE base rope_parameters["sliding_attention"].rope_theta (rope_local_base_freq in
    4.x configs), unscaled;  full layers: rope_parameters["full_attention"] (default / linear / llama3)

Final-logit soft-capping is honoured when a config sets it (Gemma 3 checkpoints do not);
`attn_logit_softcapping` is ignored, as transformers' Gemma 3 attention ignores it.  The vision-language
`gemma3` model type (Gemma3ForConditionalGeneration) is not a causal LM of ours; its text tower's
config is.  megatron-core cannot build it (as Gemma 2: post-norms, embedding scaling).
"""
from __future__ import annotations

from typing import Any

from ..config import ConfigError
from .base import Architecture, Row, edit_rows, rope_fields
from .gemma2 import WEIGHTS as GEMMA2_WEIGHTS
from .gemma2 import gemma_fields
from .llama import H, L

WEIGHTS = edit_rows(GEMMA2_WEIGHTS, after={L + "self_attention.linear_qkv.bias": (
    Row(L + "self_attention.q_layernorm.weight", H + "self_attn.q_norm.weight"),
    Row(L + "self_attention.k_layernorm.weight", H + "self_attn.k_norm.weight"))})


def _rope_by_layer_type(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full-attention, sliding-attention) RoPE parameters, transformers >= 5 or 4.x."""
    params = data.get("rope_parameters") or {}
    if "full_attention" in params:
        return dict(params["full_attention"]), dict(params.get("sliding_attention") or {"rope_theta": 10000.0})
    full = {"rope_theta": data.get("rope_theta", 1_000_000.0), **(data.get("rope_scaling") or {})}
    return full, {"rope_type": "default", "rope_theta": data.get("rope_local_base_freq", 10000.0)}


def _fields(data: dict[str, Any]) -> dict[str, Any]:
    full, sliding = _rope_by_layer_type(data)
    if sliding.get("rope_type", sliding.get("type", "default")) != "default":
        raise ConfigError(f"gemma3_text rope_parameters.sliding_attention.rope_type "
                          f"{sliding.get('rope_type', sliding.get('type'))!r} is not supported; expected 'default'")
    try:
        rope = rope_fields({"rope_parameters": full})
    except ConfigError as error:
        raise ConfigError(f"gemma3_text rope_parameters.full_attention: {error}") from None
    return {**gemma_fields(data), **rope, "qk_layernorm": True, "local_rotary_base": float(sliding["rope_theta"]),
            "attn_logit_softcapping": None}  # transformers' Gemma 3 never passes it to attention


GEMMA3 = Architecture("gemma3_text", ("Gemma3ForCausalLM",), _fields, WEIGHTS)
