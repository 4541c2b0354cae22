"""One architecture-neutral ModelConfig (Megatron's vocabulary) and its validation.

What a family's HF config means lives in `hf_megatron.architectures` (one record per family),
which sits *above* this module.  So `ModelConfig.from_hf` reads an HF config through a reader
that the architectures package installs when it is imported (`hf_megatron/__init__.py` imports
it): the dependency points down, and config.py names no family.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import ConfigError  # re-exported

# HF config dict -> ModelConfig keyword arguments; installed by hf_megatron.architectures
_hf_reader: Callable[[dict[str, Any]], dict[str, Any]] | None = None


def has_endoftext(vocab: str | Path) -> bool:
    """Whether a GPT-2 vocab.json holds '<|endoftext|>', where Megatron-LM's GPT2BPETokenizer takes
    its end-of-document id from (shared by the checkpoint and data layers)."""
    try:
        return "<|endoftext|>" in json.loads(Path(vocab).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def null_tokenizer_eod(tokenizer_type: str | None) -> int:
    """1 for NullTokenizer, else 0: Megatron-LM's --vocab-size N (args.vocab_size) sizes megatron-core's
    NullTokenizer, whose ids are 0..N-1 and whose eod is N: N + 1 ids, the vocabulary Megatron-LM pads
    (shared by the model flags, the checkpoint args and their reader)."""
    return int(tokenizer_type == "NullTokenizer")


def install_hf_reader(reader: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Set the function `ModelConfig.from_hf` uses to read an HF config (hf_megatron.architectures')."""
    global _hf_reader
    _hf_reader = reader


@dataclass
class ModelConfig:
    """Architecture-neutral description of a decoder-only GPT model (Megatron's vocabulary)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    ffn_hidden_size: int
    num_query_groups: int | None = None  # None -> MHA (= num_attention_heads)
    kv_channels: int | None = None  # head dim; None -> hidden / heads
    max_position_embeddings: int = 2048
    position_embedding_type: str = "rope"  # "rope" | "learned_absolute"
    rotary_base: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF rope_parameters minus rope_theta
    normalization: str = "RMSNorm"  # "RMSNorm" | "LayerNorm"
    norm_epsilon: float = 1e-5
    activation: str = "swiglu"  # "swiglu" | "geglu" (gated, tanh GELU: Gemma) | "gelu_tanh" | "gelu"
    add_qkv_bias: bool = False
    add_proj_bias: bool = False  # bias on linear_proj
    add_mlp_bias: bool = False  # bias on linear_fc1 / linear_fc2
    qk_layernorm: bool = False  # per-head norm (over kv_channels) on q and k, before RoPE (Qwen3)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    # --- options of the newer families; the defaults are the plain pre-norm GPT above
    qk_layernorm_scope: str = "head"  # "head": over kv_channels (Qwen3, Gemma 3); "projection": over all heads (OLMo 2)
    pre_layernorm: bool = True  # input_layernorm / pre_mlp_layernorm before attention / MLP (False: OLMo 2)
    post_layernorm: bool = False  # post_self_attn_layernorm / post_mlp_layernorm before the residual add (Gemma, OLMo 2)
    layernorm_zero_centered_gamma: bool = False  # RMSNorm scales by (1 + w) (Gemma; megatron-core's name)
    embedding_multiplier: float = 1.0  # word embeddings times this, in their dtype (Gemma: sqrt(hidden))
    softmax_scale: float | None = None  # attention scores scale; None: 1 / sqrt(kv_channels)
    attn_logit_softcapping: float | None = None  # scores <- c * tanh(scores / c) before the mask (Gemma 2)
    final_logit_softcapping: float | None = None  # logits <- c * tanh(logits / c) (Gemma 2)
    layer_types: list[str] | None = None  # per layer "sliding_attention" | "full_attention"; None: all alike
    local_rotary_base: float | None = None  # RoPE base of sliding layers (Gemma 3); None: rotary_base
    rotary_percent: float = 1.0  # fraction of each head's dims that RoPE rotates (Phi-3 partial rotary)
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    embedding_dropout: float = 0.0
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    # the HF config this was built from (a plain dict), for writing config.json back out
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_types()
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by "
                    f"num_attention_heads={self.num_attention_heads}; set kv_channels (head_dim)"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups (num_key_value_heads)={self.num_query_groups}"
            )
        if self.position_embedding_type not in ("rope", "learned_absolute"):
            raise ConfigError(f"position_embedding_type must be 'rope' or 'learned_absolute', got {self.position_embedding_type!r}")
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ConfigError(f"normalization must be 'RMSNorm' or 'LayerNorm', got {self.normalization!r}")
        if not isinstance(self.qk_layernorm, bool):
            raise ConfigError(f"qk_layernorm must be true or false, got {self.qk_layernorm!r}")
        if self.activation not in ("swiglu", "geglu", "gelu_tanh", "gelu"):
            raise ConfigError(f"activation must be 'swiglu', 'geglu', 'gelu_tanh' or 'gelu', got {self.activation!r}")
        if self.qk_layernorm_scope not in ("head", "projection"):
            raise ConfigError(f"qk_layernorm_scope must be 'head' or 'projection', got {self.qk_layernorm_scope!r}")
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)
            bad = sorted(set(self.layer_types) - {"sliding_attention", "full_attention"})
            if len(self.layer_types) != self.num_layers or bad:
                raise ConfigError(f"layer_types must list 'sliding_attention' or 'full_attention' for each of the "
                                  f"{self.num_layers} layers, got {self.layer_types!r}")
        if self.rotary_percent != 1.0 and (not 0.0 < self.rotary_percent < 1.0
                                           or int(self.kv_channels * self.rotary_percent) % 2):
            raise ConfigError(f"rotary_percent (partial_rotary_factor)={self.rotary_percent} must be in (0, 1] and "
                              f"rotate an even number of the {self.kv_channels} head dims")

    def _check_types(self) -> None:
        """Sizes are positive integers, scales positive numbers, dropouts in [0, 1): one line naming the field."""
        if not isinstance(self.model_type, str):
            raise ConfigError(f"model_type: expected a string, got {self.model_type!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size",
                     "num_query_groups", "kv_channels", "max_position_embeddings", "sliding_window",
                     "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            optional = name in ("num_query_groups", "kv_channels", "sliding_window")
            if (value is not None or not optional) and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}: expected a positive integer, got {value!r}")
        for name in ("norm_epsilon", "rotary_base", "init_method_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"{name}: expected a positive number, got {value!r}")
        for name in ("hidden_dropout", "attention_dropout", "embedding_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ConfigError(f"{name}: expected a probability in [0, 1), got {value!r}")

    @property
    def gated_mlp(self) -> bool:
        return self.activation in ("swiglu", "geglu")

    def layer_type(self, layer: int) -> str:
        """'sliding_attention' or 'full_attention' for global layer number `layer`."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        return "sliding_attention" if self.sliding_window is not None else "full_attention"

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Megatron's rule: round vocab up to a multiple of make_vocab_size_divisible_by * tp."""
        multiple = max(1, self.make_vocab_size_divisible_by) * tp_size
        return -(-self.vocab_size // multiple) * multiple

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_hf(cls, hf_config: Any, **overrides: Any) -> "ModelConfig":
        """Build from a `transformers.PretrainedConfig` (or its `to_dict()`)."""
        data = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        if _hf_reader is None:  # only when hf_megatron.config is loaded without its package
            raise ConfigError("no architectures are registered; import hf_megatron.architectures")
        kwargs = _hf_reader(data)
        kwargs.update(overrides)
        return cls(model_type=data.get("model_type"), hf_config=dict(data), **kwargs)
