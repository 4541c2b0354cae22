"""The `args` namespace stored in Megatron checkpoints, both ways.

`build_args(config, tp, pp)` writes Megatron-LM's argument names (num_layers, hidden_size,
num_query_groups, padded_vocab_size, swiglu, untie_embeddings_and_output_weights, ...) plus
`hf_config` (the transformers config dict, so conversion back to HF is exact) and
`hf_megatron_version`.

`config_from_args(args)` reads any Megatron checkpoint's args back into a ModelConfig: from
`hf_config` when we wrote it, otherwise by recognising the architecture from Megatron's flags
(LayerNorm + learned positions + GELU -> gpt2; RMSNorm + RoPE + SwiGLU -> llama, or qwen2
when only QKV has a bias).
"""
from __future__ import annotations

import argparse
from importlib import metadata
from typing import Any

from ..config import ConfigError, ModelConfig


def build_args(config: ModelConfig, tp: int = 1, pp: int = 1, vpp: int | None = None, dp: int = 1,
               **extra: Any) -> argparse.Namespace:
    rope = config.rope_scaling or {}
    args = dict(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        group_query_attention=config.num_query_groups != config.num_attention_heads,
        kv_channels=config.kv_channels,
        max_position_embeddings=config.max_position_embeddings,
        seq_length=None,  # the training sequence length: set by the trainer through save_checkpoint(args=...)
        vocab_size=config.vocab_size,
        padded_vocab_size=config.padded_vocab_size(tp),
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_per_virtual_pipeline_stage=config.num_layers // (pp * vpp) if vpp else None,
        data_parallel_size=dp,
        world_size=tp * pp * dp,
        normalization=config.normalization,
        norm_epsilon=config.norm_epsilon,
        layernorm_epsilon=config.norm_epsilon,
        swiglu=config.activation == "swiglu",
        openai_gelu=config.activation == "gelu_tanh",
        position_embedding_type=config.position_embedding_type,
        rotary_base=config.rotary_base,
        rotary_percent=1.0,
        use_rope_scaling=rope.get("rope_type") == "llama3",
        rope_scaling_factor=rope.get("factor", 8.0),
        untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        add_qkv_bias=config.add_qkv_bias,
        add_bias_linear=config.add_proj_bias or config.add_mlp_bias,
        hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout,
        init_method_std=config.init_method_std,
        window_size=(config.sliding_window - 1, 0) if config.sliding_window else None,
        apply_query_key_layer_scaling=False,
        use_legacy_models=False,
        transformer_impl="local",
        ckpt_format="torch",
        hf_config=dict(config.hf_config),
        hf_megatron_version=_version(),
    )
    args.update(extra)
    return argparse.Namespace(**args)


def _version() -> str:
    """The installed hf_megatron's version (the package root, which has __version__, sits above
    this layer)."""
    try:
        return metadata.version("hf_megatron")
    except metadata.PackageNotFoundError:
        return "unknown"


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default) if not isinstance(args, dict) else args.get(name, default)


def config_from_args(args: Any, vocab_size: int | None = None) -> ModelConfig:
    """ModelConfig for a checkpoint's args (a Namespace, one of our stand-ins, or a dict)."""
    if args is None:
        raise ConfigError("checkpoint has no 'args'; cannot tell the architecture")
    divisible = _get(args, "make_vocab_size_divisible_by", 128) or 128
    hf_config = _get(args, "hf_config")
    if isinstance(hf_config, dict) and hf_config.get("model_type"):
        return ModelConfig.from_hf(hf_config, make_vocab_size_divisible_by=divisible)
    return ModelConfig.from_hf(hf_config_from_megatron_args(args, vocab_size), make_vocab_size_divisible_by=divisible)


def hf_config_from_megatron_args(args: Any, vocab_size: int | None = None) -> dict[str, Any]:
    """A transformers config dict for a checkpoint written by Megatron-LM (no `hf_config` in it)."""
    need = ("num_layers", "hidden_size", "num_attention_heads")
    missing = [n for n in need if _get(args, n) is None]
    if missing:
        raise ConfigError(f"checkpoint args lack {', '.join(missing)}; cannot tell the architecture")
    heads, hidden = _get(args, "num_attention_heads"), _get(args, "hidden_size")
    vocab = vocab_size or _get(args, "vocab_size") or _get(args, "padded_vocab_size")
    if not vocab:
        raise ConfigError("checkpoint args lack padded_vocab_size; pass the vocabulary size")
    ffn = _get(args, "ffn_hidden_size") or 4 * hidden
    norm = _get(args, "normalization", "LayerNorm")
    positions = _get(args, "position_embedding_type", "learned_absolute")
    swiglu = bool(_get(args, "swiglu", False))
    eps = _get(args, "norm_epsilon", _get(args, "layernorm_epsilon", 1e-5))
    bias_linear = bool(_get(args, "add_bias_linear", True))
    if norm == "LayerNorm" and positions == "learned_absolute" and not swiglu:
        if not bias_linear:
            raise ConfigError("GPT-style checkpoint without linear biases (add_bias_linear=False) has no HF equivalent")
        return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=vocab, n_embd=hidden,
                    n_layer=_get(args, "num_layers"), n_head=heads, n_inner=ffn,
                    n_positions=_get(args, "max_position_embeddings"), layer_norm_epsilon=eps,
                    activation_function="gelu_new" if _get(args, "openai_gelu") else "gelu",
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if norm == "RMSNorm" and positions == "rope" and swiglu:
        groups = _get(args, "num_query_groups") if _get(args, "group_query_attention") else heads
        qkv_bias = bool(_get(args, "add_qkv_bias", False))
        model_type = "qwen2" if qkv_bias and not bias_linear else "llama"
        config = dict(model_type=model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                      num_hidden_layers=_get(args, "num_layers"), num_attention_heads=heads,
                      num_key_value_heads=groups or heads, head_dim=_get(args, "kv_channels") or hidden // heads,
                      max_position_embeddings=_get(args, "max_position_embeddings"), rms_norm_eps=eps,
                      rope_theta=float(_get(args, "rotary_base", 10000)), hidden_act="silu",
                      tie_word_embeddings=not _get(args, "untie_embeddings_and_output_weights", False))
        if model_type == "llama":
            config.update(architectures=["LlamaForCausalLM"], attention_bias=bias_linear, mlp_bias=bias_linear)
            if _get(args, "use_rope_scaling"):
                config["rope_scaling"] = {"rope_type": "llama3", "factor": _get(args, "rope_scaling_factor", 8.0),
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192}
        else:
            config["architectures"] = ["Qwen2ForCausalLM"]
        return config
    raise ConfigError(f"checkpoint architecture (normalization={norm}, position_embedding_type={positions}, "
                      f"swiglu={swiglu}) matches none of gpt2, llama, mistral, qwen2")
