"""The `args` namespace stored in Megatron checkpoints, both ways.

`build_args(config, tp, pp)` writes Megatron-LM's argument names (num_layers, hidden_size,
num_query_groups, padded_vocab_size, swiglu, untie_embeddings_and_output_weights, ...) plus
`hf_config` (the transformers config dict, so conversion back to HF is exact) and
`hf_megatron_version`.

`config_from_args(args)` reads any Megatron checkpoint's args back into a ModelConfig: from
`hf_config` when we wrote it, otherwise by each architecture record's recogniser of Megatron's
flags (`hf_megatron.architectures.hf_config_from_megatron_args`).
"""
from __future__ import annotations

import argparse
from importlib import metadata
from typing import Any

from ..architectures import hf_config_from_megatron_args
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
        apply_layernorm_1p=config.layernorm_zero_centered_gamma,  # Megatron-LM's name for (1 + w) norms
        norm_epsilon=config.norm_epsilon,
        layernorm_epsilon=config.norm_epsilon,
        swiglu=config.activation == "swiglu",
        openai_gelu=config.activation == "gelu_tanh",
        position_embedding_type=config.position_embedding_type,
        rotary_base=config.rotary_base,
        rotary_percent=config.rotary_percent,
        use_rope_scaling=rope.get("rope_type") == "llama3",
        rope_scaling_factor=rope.get("factor", 8.0),
        untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        add_qkv_bias=config.add_qkv_bias,
        qk_layernorm=config.qk_layernorm,
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
