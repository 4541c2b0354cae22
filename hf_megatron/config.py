"""One ModelConfig for every supported architecture, built from a transformers config.

A per-architecture *adapter* reads the fields of one HF config class and fills the
architecture-neutral `ModelConfig`.  Adding an architecture (gpt_neox, gemma, phi3,
...) means writing one adapter function and registering it in `ADAPTERS`, plus its
weight mapping in `hf_megatron/conversion/mappings.py`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


from .errors import ConfigError  # noqa: E402  (re-exported)


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
    activation: str = "swiglu"  # "swiglu" | "gelu_tanh" | "gelu"
    add_qkv_bias: bool = False
    add_proj_bias: bool = False  # bias on linear_proj
    add_mlp_bias: bool = False  # bias on linear_fc1 / linear_fc2
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    embedding_dropout: float = 0.0
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    # the HF config this was built from (a plain dict), for writing config.json back out
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
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
        if self.activation not in ("swiglu", "gelu_tanh", "gelu"):
            raise ConfigError(f"activation must be 'swiglu', 'gelu_tanh' or 'gelu', got {self.activation!r}")

    @property
    def gated_mlp(self) -> bool:
        return self.activation == "swiglu"

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
        model_type = data.get("model_type")
        adapter = ADAPTERS.get(model_type)
        if adapter is None:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(ADAPTERS))}"
            )
        kwargs = adapter(data)
        kwargs.update(overrides)
        return cls(model_type=model_type, hf_config=dict(data), **kwargs)


# ---------------------------------------------------------------------------- adapters


def _rope_fields(data: dict[str, Any]) -> dict[str, Any]:
    """Read RoPE settings from transformers >= 5 (`rope_parameters`) or 4.x (`rope_theta`, `rope_scaling`)."""
    params = dict(data.get("rope_parameters") or {})
    if not params:
        params = dict(data.get("rope_scaling") or {})
        if "rope_theta" in data:
            params["rope_theta"] = data["rope_theta"]
    theta = float(params.pop("rope_theta", data.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"unsupported rope type {rope_type!r} (rope_parameters/rope_scaling); "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("partial_rotary_factor != 1.0 is not supported")
    params["rope_type"] = rope_type
    params.pop("type", None)
    return {"rotary_base": theta, "rope_scaling": None if rope_type == "default" else params}


def _llama_like(data: dict[str, Any]) -> dict[str, Any]:
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
        **_rope_fields(data),
    )


def _llama(data: dict[str, Any]) -> dict[str, Any]:
    return _llama_like(data)


def _mistral(data: dict[str, Any]) -> dict[str, Any]:
    kwargs = _llama_like(data)
    kwargs["sliding_window"] = data.get("sliding_window")
    return kwargs


def _qwen2(data: dict[str, Any]) -> dict[str, Any]:
    kwargs = _llama_like(data)
    kwargs.update(add_qkv_bias=True, add_proj_bias=False)  # Qwen2: bias on q/k/v only
    if data.get("use_sliding_window"):
        raise ConfigError("qwen2 with use_sliding_window=True is not supported")
    return kwargs


def _gpt2(data: dict[str, Any]) -> dict[str, Any]:
    act = data.get("activation_function", "gelu_new")
    acts = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    if act not in acts:
        raise ConfigError(f"gpt2 activation_function {act!r} is not supported; expected one of {sorted(acts)}")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if data.get(flag):
            raise ConfigError(f"gpt2 config field {flag}=True is not supported")
    hidden = data["n_embd"]
    return dict(
        vocab_size=data["vocab_size"],
        hidden_size=hidden,
        num_layers=data["n_layer"],
        num_attention_heads=data["n_head"],
        ffn_hidden_size=data.get("n_inner") or 4 * hidden,
        max_position_embeddings=data.get("n_positions", 1024),
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        norm_epsilon=data.get("layer_norm_epsilon", 1e-5),
        activation=acts[act],
        add_qkv_bias=True,
        add_proj_bias=True,
        add_mlp_bias=True,
        tie_word_embeddings=True,  # GPT2LMHeadModel always ties lm_head to wte
        hidden_dropout=float(data.get("resid_pdrop", 0.0)),
        attention_dropout=float(data.get("attn_pdrop", 0.0)),
        embedding_dropout=float(data.get("embd_pdrop", 0.0)),
        init_method_std=data.get("initializer_range", 0.02),
    )


ADAPTERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
}
