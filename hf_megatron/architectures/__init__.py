"""Per model family knowledge, one `Architecture` record (one file) per family.

A record holds the family's HF config adapter, HF class names, parallel plan, weight-mapping
table (both directions derived from it) and its recognition from Megatron-LM flags; see
`base.py`.  Adding a family (gemma, phi3, qwen3, ...) is one file defining a record plus one
line in `_BUILTIN` below.

Importing this package installs `config_fields` as `ModelConfig.from_hf`'s reader (config.py
sits below this package and must not import it); `hf_megatron/__init__.py` imports it.
"""
from __future__ import annotations

from typing import Any, Iterator

from .. import config as _config
from ..config import ConfigError, ModelConfig
from .base import Architecture, Getter, MegatronArgs, Pair, Row, Transform
from .gemma2 import GEMMA2
from .gemma3 import GEMMA3
from .gpt2 import GPT2
from .llama import LLAMA
from .mistral import MISTRAL
from .olmo2 import OLMO2
from .phi3 import PHI3
from .plan import Shard, gpt_plan
from .qwen2 import QWEN2
from .qwen3 import QWEN3

_BUILTIN = (GPT2, LLAMA, MISTRAL, QWEN2, QWEN3, OLMO2, PHI3, GEMMA2, GEMMA3)
REGISTRY: dict[str, Architecture] = {arch.model_type: arch for arch in _BUILTIN}
SUPPORTED = REGISTRY.keys()  # a live view: also lists families registered later


def register(arch: Architecture) -> Architecture:
    """Add a family (e.g. from outside the package); a model_type registers once."""
    if arch.model_type in REGISTRY:
        raise ValueError(f"model_type {arch.model_type!r} is already registered")
    REGISTRY[arch.model_type] = arch
    return arch


def get(model_type: str | None) -> Architecture:
    try:
        return REGISTRY[model_type]
    except KeyError:
        raise ConfigError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(SUPPORTED))}") from None


# HF config fields that, where present and set, must be positive integers (every family's names)
POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                       "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
                       "n_embd", "n_layer", "n_head", "n_inner", "n_positions")
# of those, the ones that may not be null where they appear (the others mean "default" as null)
REQUIRED_IF_PRESENT = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                       "n_embd", "n_layer", "n_head")


def config_fields(data: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for an HF config dict (its family's adapter).  A required
    field that is absent is an error, never filled with transformers' default."""
    for key in POSITIVE_INT_FIELDS:
        value = data.get(key)
        unset_ok = key not in REQUIRED_IF_PRESENT or key not in data
        if (value is not None or not unset_ok) and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"field {key!r}: expected a positive integer, got {value!r}")
    arch = get(data.get("model_type"))
    try:
        return arch.adapter(data)
    except KeyError as exc:
        raise ConfigError(f"field {exc.args[0]!r} missing ({arch.model_type} needs it; no default is assumed)") from None
    except ConfigError:  # a value the adapter names as unsupported: its own message, not "wrong type"
        raise
    except (TypeError, ValueError, AttributeError) as exc:  # a field of the wrong kind (a list for a number, ...)
        raise ConfigError(f"a field has the wrong type for {arch.model_type} ({type(exc).__name__}: {exc})") from None


_config.install_hf_reader(config_fields)


def config_from_hf(hf_config: Any, **overrides: Any) -> ModelConfig:
    return ModelConfig.from_hf(hf_config, **overrides)


def plan_for(config: ModelConfig) -> dict[str, Shard]:
    """The parallel plan of config's architecture family."""
    return get(config.model_type).plan(config)


def hf_to_mcore(get_hf: Getter, config: ModelConfig, layers=None) -> Iterator[Pair]:
    """Yield full megatron-core tensors from HF tensors (`get_hf(hf_name)`); `layers`: the global
    layer numbers to convert (default all) -- embeddings, final norm and output always come."""
    return get(config.model_type).hf_to_mcore(get_hf, config, layers)


def mcore_to_hf(get_mcore: Getter, config: ModelConfig, layers=None) -> Iterator[Pair]:
    """Yield HF tensors from full megatron-core tensors (`get_mcore(mcore_name)`); vocab unpadded by caller."""
    return get(config.model_type).mcore_to_hf(get_mcore, config, layers)


def hf_class_name(model_type: str) -> str:
    """The transformers causal-LM class written to config.json `architectures`."""
    return get(model_type).hf_class


def hf_config_from_megatron_args(args: Any, vocab_size: int | None = None,
                                 what: str = "checkpoint architecture") -> dict[str, Any]:
    """A transformers config dict for a checkpoint written by Megatron-LM (no `hf_config` in it), or
    for Megatron-LM's model flags: the first registered family whose recogniser claims the flags.
    `what` names the source in the error."""
    view = MegatronArgs(args, vocab_size)
    for arch in REGISTRY.values():
        fields = arch.from_megatron_args(view) if arch.from_megatron_args else None
        if fields is not None:
            return {"model_type": arch.model_type, "architectures": [arch.hf_class], **fields}
    raise ConfigError(f"{what} ({view.describe()}) matches none of {', '.join(SUPPORTED)}")


__all__ = ["Architecture", "ConfigError", "MegatronArgs", "REGISTRY", "Row", "SUPPORTED", "Shard", "Transform",
           "config_fields", "config_from_hf", "get", "gpt_plan", "hf_class_name", "hf_config_from_megatron_args",
           "hf_to_mcore", "mcore_to_hf", "plan_for", "register"]
