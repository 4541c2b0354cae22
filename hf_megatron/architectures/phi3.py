"""Phi-3: Llama's layer with HF's fused projections, partial rotary and "longrope" scaling.

HF fuses q, k, v into one `qkv_proj` ([q; k; v] rows) and gate, up into `gate_up_proj`
([gate; up] rows: already megatron-core's full fc1).  RoPE ("default", or "longrope" -- "su" and
"yarn" in older Phi-3 configs, which transformers reads as longrope) rotates the first
d = int(head_dim * partial_rotary_factor) dims of each head; longrope's inverse frequencies are
1 / (f_i * base^(2i/d)), f = long_factor when the sequence is longer than
original_max_position_embeddings, else short_factor, and cos/sin are scaled by
    attention_factor = sqrt(1 + ln(factor) / ln(original_max_position_embeddings))  (1 if factor <= 1),
    factor = max_position_embeddings / original_max_position_embeddings  unless given.
A sliding window, when set, applies to every layer (transformers' Phi-3 mask).
From Megatron-LM's flags alone (no `args.hf_config`), Llama's flags with `--rotary-percent` < 1
and no biases read back as Phi-3 with that partial_rotary_factor; whole-head RoPE reads as Llama
(the same tensors).  longrope has no Megatron flag: our checkpoints carry the HF config.
"""
from __future__ import annotations

import math
from typing import Any

from ..config import ConfigError
from .base import PACKED_QKV, Architecture, MegatronArgs, Row
from .llama import WEIGHTS as LLAMA_WEIGHTS
from .llama import H, L, llama_like_fields, llama_like_hf_config

_FUSED = {
    L + "self_attention.linear_qkv.weight": Row(L + "self_attention.linear_qkv.weight", H + "self_attn.qkv_proj.weight",
                                                PACKED_QKV),
    L + "mlp.linear_fc1.weight": Row(L + "mlp.linear_fc1.weight", H + "mlp.gate_up_proj.weight"),
}
# Phi-3 has no biases
WEIGHTS = tuple(_FUSED.get(row.mcore, row) for row in LLAMA_WEIGHTS if row.when in (None, "not tie_word_embeddings"))

ROPE_TYPES = {"default": "default", "longrope": "longrope", "su": "longrope", "yarn": "longrope"}


def _rope_parameters(data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the config field they came from, RoPE parameters) of transformers >= 5 or 4.x configs."""
    if data.get("rope_parameters"):
        return "rope_parameters", dict(data["rope_parameters"])
    params = dict(data.get("rope_scaling") or {})
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in data:
            params.setdefault(key, data[key])
    return "rope_scaling", params


def rope_fields(data: dict[str, Any]) -> dict[str, Any]:
    field, params = _rope_parameters(data)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"phi3 {field}.rope_type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    percent = float(params.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0)))
    fields = {"rotary_base": float(params.get("rope_theta", 10000.0)), "rotary_percent": percent, "rope_scaling": None}
    if ROPE_TYPES[kind] == "default":
        return fields
    head_dim = data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"]
    pairs = int(head_dim * percent) // 2
    for key in ("short_factor", "long_factor"):
        factors = params.get(key)
        if not isinstance(factors, list) or len(factors) != pairs:
            raise ConfigError(f"phi3 {field}.{key} must be a list of {pairs} numbers (rotary dims / 2), got {factors!r}")
    original = params.get("original_max_position_embeddings", data.get("original_max_position_embeddings"))
    if not original:
        raise ConfigError(f"phi3 longrope needs original_max_position_embeddings ({field} or the config)")
    factor = params.get("factor") or data["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    fields["rope_scaling"] = {"rope_type": "longrope", "short_factor": list(params["short_factor"]),
                              "long_factor": list(params["long_factor"]), "original_max_position_embeddings": original,
                              "factor": factor, "attention_factor": attention_factor}
    return fields


def _fields(data: dict[str, Any]) -> dict[str, Any]:
    llama_view = {k: v for k, v in data.items() if k not in ("rope_parameters", "rope_scaling", "partial_rotary_factor")}
    return {**llama_like_fields(llama_view), **rope_fields(data), "sliding_window": data.get("sliding_window"),
            "hidden_dropout": float(data.get("resid_pdrop", 0.0)),
            "embedding_dropout": float(data.get("embd_pdrop", 0.0))}


def _from_megatron_args(args: MegatronArgs) -> dict[str, Any] | None:
    percent = float(args.get("rotary_percent", 1.0) or 1.0)
    if (percent == 1.0 or args.normalization != "RMSNorm" or args.positions != "rope" or not args.swiglu
            or args.get("qk_layernorm") or args.bias_linear or args.qkv_bias):
        return None
    config = llama_like_hf_config(args)
    theta = config.pop("rope_theta")
    return {**config, "rope_parameters": {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": percent}}


PHI3 = Architecture("phi3", ("Phi3ForCausalLM",), _fields, WEIGHTS, from_megatron_args=_from_megatron_args)
