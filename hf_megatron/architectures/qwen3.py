"""Qwen3: Llama's weights plus a per-head RMSNorm on q and k (after the projection, before RoPE).

    q_h = RMSNorm_q(W_q,h x),  k_g = RMSNorm_k(W_k,g x)   over head_dim, one [head_dim] weight each

`head_dim` may differ from hidden / heads; `attention_bias` puts a bias on q, k, v and o alike
(Llama's rule); the MLP has none.  A sliding window is honoured when every layer slides (our
model has one window for all layers); a mix of sliding and full layers is refused.
"""
from __future__ import annotations

from typing import Any

from ..config import ConfigError
from .base import Architecture, MegatronArgs, Row
from .llama import WEIGHTS as LLAMA_WEIGHTS
from .llama import L, H, is_llama_like, llama3_rope_scaling, llama_like_fields, llama_like_hf_config

QK_NORMS = (
    Row(L + "self_attention.q_layernorm.weight", H + "self_attn.q_norm.weight", when="qk_layernorm"),
    Row(L + "self_attention.k_layernorm.weight", H + "self_attn.k_norm.weight", when="qk_layernorm"),
)
_AT = next(i for i, row in enumerate(LLAMA_WEIGHTS) if row.mcore.endswith("linear_proj.weight"))
WEIGHTS = LLAMA_WEIGHTS[:_AT] + QK_NORMS + LLAMA_WEIGHTS[_AT:]  # the norms next to linear_qkv


def _sliding_window(data: dict[str, Any]) -> int | None:
    """transformers' rule: the window applies only with use_sliding_window, on layers typed
    'sliding_attention' (by default those at index >= max_window_layers)."""
    window = data.get("sliding_window")
    if not data.get("use_sliding_window") or window is None:
        return None
    layers = data["num_hidden_layers"]
    types = data.get("layer_types") or [
        "sliding_attention" if i >= data.get("max_window_layers", 28) else "full_attention" for i in range(layers)]
    sliding = sum(t == "sliding_attention" for t in types)
    if sliding == 0:
        return None
    if sliding < len(types):
        raise ConfigError(f"qwen3 with use_sliding_window=True on {sliding} of {len(types)} layers (layer_types / "
                          "max_window_layers) is not supported; only all layers or none")
    return window


def _fields(data: dict[str, Any]) -> dict[str, Any]:
    return {**llama_like_fields(data), "qk_layernorm": True, "sliding_window": _sliding_window(data)}


def _from_megatron_args(args: MegatronArgs) -> dict[str, Any] | None:
    # Qwen3's attention_bias would be q, k, v and o with an unbiased MLP: no Megatron flag says that
    if not is_llama_like(args, qk_layernorm=True) or args.bias_linear or args.qkv_bias:
        return None
    return {**llama_like_hf_config(args), "attention_bias": False, **llama3_rope_scaling(args)}


QWEN3 = Architecture("qwen3", ("Qwen3ForCausalLM",), _fields, WEIGHTS, from_megatron_args=_from_megatron_args)
