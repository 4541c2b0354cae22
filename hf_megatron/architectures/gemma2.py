"""Gemma 2: pre- and post-norms around attention and MLP, (1 + w) RMSNorm, GeGLU, soft-capping.

    h = x * sqrt(hidden)                          (in the embedding's dtype, as transformers)
    x += post_attn_norm(attn(input_norm(x)));  x += post_mlp_norm(mlp(pre_mlp_norm(x)))
    norm(x) = x / rms(x) * (1 + w)                 (zero-centred weights, fp32, cast once)
    mlp(x) = W_down (gelu_tanh(W_gate x) * W_up x)
    attn: scores = c_a * tanh(q k^T / sqrt(query_pre_attn_scalar) / c_a), sliding window on the
          layers `layer_types` calls "sliding_attention";   logits = c_f * tanh(logits / c_f)

megatron-core's GPTModel has no post-norms, embedding scaling or soft-capping, so it cannot
build Gemma; Megatron-LM's flags do not describe it either (our checkpoints carry the HF config).
"""
from __future__ import annotations

from typing import Any

from ..config import ConfigError
from .base import Architecture, Row, edit_rows, rope_fields
from .llama import WEIGHTS as LLAMA_WEIGHTS
from .llama import H, L

WEIGHTS = edit_rows(LLAMA_WEIGHTS, drop=(L + "pre_mlp_layernorm.weight",), after={
    L + "self_attention.linear_proj.bias": (
        Row(L + "post_self_attn_layernorm.weight", H + "post_attention_layernorm.weight"),
        Row(L + "pre_mlp_layernorm.weight", H + "pre_feedforward_layernorm.weight")),
    L + "mlp.linear_fc2.bias": (Row(L + "post_mlp_layernorm.weight", H + "post_feedforward_layernorm.weight"),),
})
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def gemma_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields Gemma 2 and Gemma 3 share (RoPE is each one's own)."""
    family = data.get("model_type")
    act = data.get("hidden_activation") or data.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GELU_TANH:
        raise ConfigError(f"{family} hidden_activation {act!r} is not supported; expected 'gelu_pytorch_tanh'")
    if data.get("use_bidirectional_attention"):
        raise ConfigError(f"{family} use_bidirectional_attention=True is not supported; causal attention only")
    layers = data["num_hidden_layers"]
    layer_types = data.get("layer_types")
    if layer_types is None:
        raise ConfigError(f"{family} config has no layer_types; expected one of 'sliding_attention' / "
                          f"'full_attention' per layer")
    bias = bool(data.get("attention_bias", False))
    return dict(
        vocab_size=data["vocab_size"], hidden_size=data["hidden_size"], num_layers=layers,
        num_attention_heads=data["num_attention_heads"],
        num_query_groups=data.get("num_key_value_heads") or data["num_attention_heads"],
        kv_channels=data.get("head_dim") or None, ffn_hidden_size=data["intermediate_size"],
        max_position_embeddings=data.get("max_position_embeddings", 8192), position_embedding_type="rope",
        normalization="RMSNorm", norm_epsilon=data.get("rms_norm_eps", 1e-6), activation="geglu",
        add_qkv_bias=bias, add_proj_bias=bias, add_mlp_bias=False,
        tie_word_embeddings=bool(data.get("tie_word_embeddings", True)),
        attention_dropout=float(data.get("attention_dropout") or 0.0), init_method_std=data.get("initializer_range", 0.02),
        pre_layernorm=True, post_layernorm=True, layernorm_zero_centered_gamma=True,
        embedding_multiplier=data["hidden_size"] ** 0.5,
        softmax_scale=float(data.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_logit_softcapping=data.get("attn_logit_softcapping"),
        final_logit_softcapping=data.get("final_logit_softcapping"),
        sliding_window=data.get("sliding_window"), layer_types=list(layer_types),
    )


def _fields(data: dict[str, Any]) -> dict[str, Any]:
    return {**gemma_fields(data), **rope_fields(data)}


GEMMA2 = Architecture("gemma2", ("Gemma2ForCausalLM",), _fields, WEIGHTS)
