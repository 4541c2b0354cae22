"""Llama: RMSNorm, RoPE (default / linear / llama3 scaling), SwiGLU, grouped-query attention.

Mistral and Qwen2 share this weight table (their files add only their config differences);
biases exist where the config says so.
"""
from __future__ import annotations

from typing import Any

from ..config import ConfigError
from .base import FUSE_QKV, GATE_UP, Architecture, MegatronArgs, Row, rope_fields

L, H = "decoder.layers.{i}.", "model.layers.{i}."


def _qkv(leaf: str) -> tuple[str, ...]:
    return tuple(f"{H}self_attn.{p}_proj.{leaf}" for p in "qkv")


def _gate_up(leaf: str) -> tuple[str, ...]:
    return (f"{H}mlp.gate_proj.{leaf}", f"{H}mlp.up_proj.{leaf}")


WEIGHTS = (
    Row("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    Row(L + "input_layernorm.weight", H + "input_layernorm.weight"),
    Row(L + "self_attention.linear_qkv.weight", _qkv("weight"), FUSE_QKV),
    Row(L + "self_attention.linear_qkv.bias", _qkv("bias"), FUSE_QKV, when="add_qkv_bias"),
    Row(L + "self_attention.linear_proj.weight", H + "self_attn.o_proj.weight"),
    Row(L + "self_attention.linear_proj.bias", H + "self_attn.o_proj.bias", when="add_proj_bias"),
    Row(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight"),
    Row(L + "mlp.linear_fc1.weight", _gate_up("weight"), GATE_UP),
    Row(L + "mlp.linear_fc1.bias", _gate_up("bias"), GATE_UP, when="add_mlp_bias"),
    Row(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight"),
    Row(L + "mlp.linear_fc2.bias", H + "mlp.down_proj.bias", when="add_mlp_bias"),
    Row("decoder.final_layernorm.weight", "model.norm.weight"),
    Row("output_layer.weight", "lm_head.weight", when="not tie_word_embeddings"),
)


def llama_like_fields(data: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a Llama-style HF config (Llama, Mistral, Qwen2 name them alike)."""
    act = data.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"hidden_act {act!r} is not supported for {data.get('model_type')}; expected 'silu'")
    bias = bool(data.get("attention_bias", False))
    return dict(
        vocab_size=data["vocab_size"],
        hidden_size=data["hidden_size"],
        num_layers=data["num_hidden_layers"],
        num_attention_heads=data["num_attention_heads"],
        num_query_groups=data.get("num_key_value_heads") or data["num_attention_heads"],
        kv_channels=data.get("head_dim") or None,
        ffn_hidden_size=data["intermediate_size"],
        max_position_embeddings=data.get("max_position_embeddings", 2048),
        position_embedding_type="rope",
        normalization="RMSNorm",
        norm_epsilon=data.get("rms_norm_eps", 1e-6),
        activation="swiglu",
        add_qkv_bias=bias,
        add_proj_bias=bias,
        add_mlp_bias=bool(data.get("mlp_bias", False)),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        attention_dropout=float(data.get("attention_dropout", 0.0)),
        init_method_std=data.get("initializer_range", 0.02),
        **rope_fields(data),
    )


def is_llama_like(args: MegatronArgs, qk_layernorm: bool = False) -> bool:
    """RMSNorm + RoPE (on whole heads) + SwiGLU; per-head q/k norms (`--qk-layernorm`) only where
    asked (Qwen3)."""
    return (args.normalization == "RMSNorm" and args.positions == "rope" and args.swiglu
            and bool(args.get("qk_layernorm", False)) == qk_layernorm
            and float(args.get("rotary_percent", 1.0) or 1.0) == 1.0)  # partial rotary: Phi-3


def llama_like_hf_config(args: MegatronArgs) -> dict[str, Any]:
    """The HF config fields Llama-style families share, from Megatron-LM flags."""
    groups = args.get("num_query_groups") if args.get("group_query_attention") else args.heads
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                num_hidden_layers=args.num_layers, num_attention_heads=args.heads,
                num_key_value_heads=groups or args.heads, head_dim=args.get("kv_channels") or args.hidden // args.heads,
                max_position_embeddings=args.max_positions, rms_norm_eps=args.eps,
                rope_theta=float(args.get("rotary_base", 10000)), hidden_act="silu",
                tie_word_embeddings=not args.get("untie_embeddings_and_output_weights", False))


def _from_megatron_args(args: MegatronArgs) -> dict[str, Any] | None:
    # Llama's attention_bias covers q, k, v and o alike: a QKV-only bias is not Llama (it is Qwen2)
    if not is_llama_like(args) or (args.qkv_bias and not args.bias_linear):
        return None
    config = llama_like_hf_config(args)
    config.update(attention_bias=args.bias_linear, mlp_bias=args.bias_linear)
    config.update(llama3_rope_scaling(args))
    return config


def llama3_rope_scaling(args: MegatronArgs) -> dict[str, Any]:
    """Megatron-LM's `--use-rope-scaling` (Llama 3.1's scheme, fixed constants) as HF rope_scaling."""
    if not args.get("use_rope_scaling"):
        return {}
    return {"rope_scaling": {"rope_type": "llama3", "factor": args.get("rope_scaling_factor", 8.0),
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}}


LLAMA = Architecture("llama", ("LlamaForCausalLM",), llama_like_fields, WEIGHTS,
                     from_megatron_args=_from_megatron_args)
