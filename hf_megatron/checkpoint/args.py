"""The `args` namespace stored in Megatron checkpoints, both ways.

`build_args(config, layout)` writes one table, `FIELDS`: every argument Megatron-LM (tag
core_v0.16.1) reads back from a checkpoint's `args`, with Megatron-LM's value for it --

    load_args_from_checkpoint   megatron/training/checkpointing.py: model shape, position
                                embedding, biases, norms, tokenizer, padded vocab, TP/PP/VPP
    load_checkpoint             args.consumed_train_samples / consumed_valid_samples, the
                                (TP, PP) check, no_save_optim / no_save_rng
    tools/checkpoint loader     fp16, bf16 (-> params_dtype), seq_length (validate_args asserts
                                seq_length or encoder_seq_length), tokenizer_type, iteration
    tools/checkpoint saver      sequence_parallel, apply_query_key_layer_scaling
    transformers' GPT-2 script  padded_vocab_size, max_position_embeddings, ffn_hidden_size,
                                bias_gelu_fusion / openai_gelu (-> activation), tokenizer_type

-- plus ours: `hf_config` (the transformers config dict, so conversion back to HF is exact),
`hf_megatron_version`.  Writers pass what only they know as a `Layout` (parallel sizes, the
parameter dtype, the training sequence length, the tokenizer, the data position).

Activation: megatron-core's MLP uses exact `F.gelu`, except with `bias_gelu_fusion` (and
linear biases) where its fused kernel is the tanh approximation
    gelu(x) ~ x/2 (1 + tanh(0.79788456 x (1 + 0.044715 x^2)))
-- so a tanh-GELU model (GPT-2) gets `bias_gelu_fusion=True`; legacy models read `openai_gelu`.

RoPE: Megatron-LM's GPT builder (gpt_builders.py) hands megatron-core's GPTModel `rope_scaling=
args.use_rope_scaling` and nothing else, so RotaryEmbedding._apply_scaling keeps its defaults --
Llama 3.1's llama3 scheme, factor 8, low / high frequency factors 1 / 4, original context 8192:

    wavelength w = 2 pi / f;  f' = f (w < 8192/4),  f / 8 (w > 8192),  otherwise
    (1 - s) f / 8 + s f with s = (8192 / w - 1) / (4 - 1)

(`--rope-scaling-factor` and `--rotary-seq-len-interpolation-factor` are parsed, never passed on;
longrope has no flag).  Any other rope_scaling (another factor, as Llama 3.2's 32, or context;
linear; longrope) is written as far as the flags go and warned about in one line
(`megatron_lm_rope_difference`): Megatron-LM would compute other RoPE frequencies from these
args, hence other logits.

`config_from_args(args)` reads any Megatron checkpoint's args back into a ModelConfig: from
`hf_config` when we wrote it, otherwise by each architecture record's recogniser of Megatron's
flags (`hf_megatron.architectures.hf_config_from_megatron_args`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import torch

from ..architectures import hf_config_from_megatron_args
from ..config import ConfigError, ModelConfig, null_tokenizer_eod
from ..config import has_endoftext as _has_endoftext

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
SP_MODEL = "tokenizer.model"  # a SentencePiece model stored without transformers' files ...
SP_KIND = "megatron_tokenizer.json"  # ... beside its Megatron-LM kind: {"tokenizer_type": ...}
SP_KINDS = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
SP_DEFAULT_KIND = "GPTSentencePieceTokenizer"  # a .model file given without --tokenizer-type


@dataclass
class Layout:
    """What a writer knows beyond the model config."""
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    dp: int = 1
    cp: int = 1
    params_dtype: torch.dtype = torch.float32
    seq_length: int | None = None  # None: max_position_embeddings (a converted model has no training length)
    sequence_parallel: bool = False
    tokenizer: dict[str, Any] = field(default_factory=lambda: {"tokenizer_type": "NullTokenizer"})
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    has_optimizer: bool = False
    has_rng: bool = False


_LAYOUT_FIELDS = frozenset(f.name for f in dataclasses.fields(Layout))


def _seq_length(c: ModelConfig, l: Layout) -> int:
    return l.seq_length or c.max_position_embeddings


def _rope(c: ModelConfig) -> dict:
    return c.rope_scaling or {}


# what RotaryEmbedding._apply_scaling uses under Megatron-LM's --use-rope-scaling (see the docstring)
MEGATRON_LM_LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192.0}


def megatron_lm_rope_difference(c: ModelConfig) -> str | None:
    """Where Megatron-LM's RoPE for these args departs from the model's rope_scaling; None where
    it is the same (no scaling, or llama3 with exactly Megatron-LM's constants)."""
    rope = _rope(c)
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return None
    if kind != "llama3":
        return f"rope_type {kind!r}"
    other = [f"{key} {rope.get(key)!r}" for key, value in MEGATRON_LM_LLAMA3_ROPE.items()
             if not isinstance(rope.get(key), (int, float)) or float(rope[key]) != value]
    return "llama3 " + ", ".join(other) if other else None


_Value = Callable[[ModelConfig, Layout], Any]
# Megatron-LM argument name -> its value for a model config and a layout
FIELDS: dict[str, _Value] = {
    # ---- model shape (load_args_from_checkpoint; check_checkpoint_args compares the first three)
    "num_layers": lambda c, l: c.num_layers,
    "hidden_size": lambda c, l: c.hidden_size,
    "num_attention_heads": lambda c, l: c.num_attention_heads,
    "ffn_hidden_size": lambda c, l: c.ffn_hidden_size,
    "num_query_groups": lambda c, l: c.num_query_groups,
    "group_query_attention": lambda c, l: c.num_query_groups != c.num_attention_heads,
    "kv_channels": lambda c, l: c.kv_channels,
    "max_position_embeddings": lambda c, l: c.max_position_embeddings,
    # validate_args: seq_length is copied to encoder_seq_length (Megatron-LM's own files hold both)
    "seq_length": _seq_length,
    "encoder_seq_length": _seq_length,
    # ---- vocabulary (padded rows are in the embedding / output tensors)
    "vocab_size": lambda c, l: c.vocab_size - null_tokenizer_eod(l.tokenizer.get("tokenizer_type")),
    "padded_vocab_size": lambda c, l: c.padded_vocab_size(l.tp),
    "make_vocab_size_divisible_by": lambda c, l: c.make_vocab_size_divisible_by,
    # ---- positions
    "position_embedding_type": lambda c, l: c.position_embedding_type,
    # validate_args refuses add_position_embedding=False unless rope
    "add_position_embedding": lambda c, l: c.position_embedding_type == "learned_absolute",
    "use_rotary_position_embeddings": lambda c, l: c.position_embedding_type == "rope",
    "rotary_base": lambda c, l: c.rotary_base,
    "rotary_percent": lambda c, l: c.rotary_percent,
    "rotary_interleaved": lambda c, l: False,
    "use_rope_scaling": lambda c, l: _rope(c).get("rope_type") == "llama3",
    "rope_scaling_factor": lambda c, l: _rope(c).get("factor", 8.0),
    # ---- blocks
    "normalization": lambda c, l: c.normalization,
    "norm_epsilon": lambda c, l: c.norm_epsilon,
    "layernorm_epsilon": lambda c, l: c.norm_epsilon,  # the name before megatron-core
    "apply_layernorm_1p": lambda c, l: c.layernorm_zero_centered_gamma,  # Megatron-LM's (1 + w) norms
    "qk_layernorm": lambda c, l: c.qk_layernorm,
    "swiglu": lambda c, l: c.activation == "swiglu",
    "squared_relu": lambda c, l: False,
    "openai_gelu": lambda c, l: c.activation == "gelu_tanh",
    "bias_gelu_fusion": lambda c, l: c.activation == "gelu_tanh" and (c.add_proj_bias or c.add_mlp_bias),
    "bias_swiglu_fusion": lambda c, l: False,
    "add_bias_linear": lambda c, l: c.add_proj_bias or c.add_mlp_bias,
    "add_qkv_bias": lambda c, l: c.add_qkv_bias,
    "untie_embeddings_and_output_weights": lambda c, l: not c.tie_word_embeddings,
    "apply_query_key_layer_scaling": lambda c, l: False,
    "hidden_dropout": lambda c, l: c.hidden_dropout,
    "attention_dropout": lambda c, l: c.attention_dropout,
    "init_method_std": lambda c, l: c.init_method_std,
    "window_size": lambda c, l: (c.sliding_window - 1, 0) if c.sliding_window else None,
    "num_experts": lambda c, l: None,
    # ---- precision (tools/checkpoint loader copies fp16 / bf16; validate_args derives params_dtype)
    "fp16": lambda c, l: l.params_dtype == torch.float16,
    "bf16": lambda c, l: l.params_dtype == torch.bfloat16,
    "params_dtype": lambda c, l: l.params_dtype,
    # ---- parallel layout (use_mp_args_from_checkpoint_args; the saver reads sequence_parallel)
    "tensor_model_parallel_size": lambda c, l: l.tp,
    "pipeline_model_parallel_size": lambda c, l: l.pp,
    "virtual_pipeline_model_parallel_size": lambda c, l: l.vpp,
    "num_layers_per_virtual_pipeline_stage": lambda c, l: c.num_layers // (l.pp * l.vpp) if l.vpp else None,
    "expert_model_parallel_size": lambda c, l: 1,
    "context_parallel_size": lambda c, l: l.cp,
    "data_parallel_size": lambda c, l: l.dp,
    "world_size": lambda c, l: l.tp * l.pp * l.cp * l.dp,
    "sequence_parallel": lambda c, l: l.sequence_parallel,
    "data_parallel_random_init": lambda c, l: False,
    # ---- implementation and format
    "use_legacy_models": lambda c, l: False,
    "transformer_impl": lambda c, l: "local",
    "ckpt_format": lambda c, l: "torch",
    # ---- tokenizer (load_args_from_checkpoint copies tokenizer_type / tokenizer_model)
    "tokenizer_type": lambda c, l: l.tokenizer.get("tokenizer_type"),
    "tokenizer_model": lambda c, l: l.tokenizer.get("tokenizer_model"),
    "vocab_file": lambda c, l: l.tokenizer.get("vocab_file"),
    "merge_file": lambda c, l: l.tokenizer.get("merge_file"),
    # ---- training state (load_checkpoint reads the data position from args)
    "iteration": lambda c, l: l.iteration,
    "consumed_train_samples": lambda c, l: l.consumed_train_samples,
    "consumed_valid_samples": lambda c, l: l.consumed_valid_samples,
    "no_save_optim": lambda c, l: not l.has_optimizer,
    "no_save_rng": lambda c, l: not l.has_rng,
}


def build_args(config: ModelConfig, layout: Layout | None = None, **entries: Any) -> argparse.Namespace:
    """The `args` of a checkpoint: FIELDS for `config` and `layout`, then ours, then `entries`.
    Entries naming a Layout field (tp=2, params_dtype=torch.bfloat16, ...) set it in the
    layout; the others are stored as they are, except None, which leaves the table's value."""
    layout = dataclasses.replace(layout or Layout(), **{k: v for k, v in entries.items() if k in _LAYOUT_FIELDS})
    extra = {k: v for k, v in entries.items() if k not in _LAYOUT_FIELDS}
    args = {name: value(config, layout) for name, value in FIELDS.items()}
    difference = megatron_lm_rope_difference(config)
    if difference:
        warnings.warn(f"hf_megatron: checkpoint args: rope_scaling {difference}: Megatron-LM's --use-rope-scaling "
                      f"is llama3 with factor 8, low_freq_factor 1, high_freq_factor 4, "
                      f"original_max_position_embeddings 8192, so a model Megatron-LM builds from these args "
                      f"computes other RoPE frequencies (hf_megatron reads the exact rope from args.hf_config)",
                      stacklevel=2)
    args.update(hf_config=dict(config.hf_config), hf_megatron_version=_version())
    args.update({k: v for k, v in extra.items() if v is not None or k not in args})
    return argparse.Namespace(**args)


def tokenizer_args(folder: str | Path | None, location: str | Path | None = None) -> dict[str, Any]:
    """Megatron-LM's tokenizer arguments for the HF tokenizer files in `folder`, naming them at
    `location` (where they will be read from; default `folder`):

        GPT-2's byte-level BPE (vocab.json + merges.txt with <|endoftext|>)
                                    GPT2BPETokenizer, vocab_file, merge_file
        tokenizer.model alone (no transformers files; its kind in megatron_tokenizer.json)
                                    that SentencePiece kind, tokenizer_model = the .model file
        any other HF tokenizer      HuggingFaceTokenizer, tokenizer_model = the folder
        none                        NullTokenizer (Megatron-LM's "ids only"; it reads vocab_size N,
                                    which FIELDS writes as the model's vocabulary - 1: eod is N)
    """
    folder = Path(folder) if folder else None
    if folder is None or not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return {"tokenizer_type": "NullTokenizer"}
    location = Path(location or folder).absolute()
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if vocab.is_file() and merges.is_file() and _has_endoftext(vocab):
        return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": str(location / vocab.name),
                "merge_file": str(location / merges.name)}
    if (folder / SP_MODEL).is_file() and not any((folder / name).is_file() for name in TOKENIZER_FILES
                                                 if name != SP_MODEL):
        return {"tokenizer_type": _sentencepiece_kind(folder), "tokenizer_model": str(location / SP_MODEL)}
    return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(location)}


def _sentencepiece_kind(folder: Path) -> str:
    try:
        kind = json.loads((folder / SP_KIND).read_text(encoding="utf-8")).get("tokenizer_type")
    except (OSError, ValueError, AttributeError):
        return SP_DEFAULT_KIND
    return kind if kind in SP_KINDS else SP_DEFAULT_KIND


def _version() -> str:
    """The installed hf_megatron's version (the package root, which has __version__, sits above
    this layer)."""
    try:
        return metadata.version("hf_megatron")
    except metadata.PackageNotFoundError:
        return "unknown"


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default) if not isinstance(args, dict) else args.get(name, default)


# model arguments that restate what args.hf_config says (FIELDS computes them from it); dropout and
# init are left out: a run may train with its own
RESTATED = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "group_query_attention",
            "kv_channels", "max_position_embeddings", "vocab_size", "position_embedding_type", "normalization",
            "norm_epsilon", "layernorm_epsilon", "apply_layernorm_1p", "qk_layernorm", "swiglu", "openai_gelu",
            "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights")
RESTATED_IF = {"num_query_groups": lambda c: c.num_query_groups != c.num_attention_heads,  # Megatron: GQA only
               "rotary_base": lambda c: c.position_embedding_type == "rope",
               "rotary_percent": lambda c: c.position_embedding_type == "rope"}


def _same(stored: Any, expected: Any) -> bool:
    if isinstance(stored, bool) or isinstance(expected, bool):
        return stored is expected or (isinstance(stored, bool) and isinstance(expected, bool) and stored == expected)
    if isinstance(stored, (int, float)) and isinstance(expected, (int, float)):
        return float(stored) == float(expected)
    return stored == expected


def check_args_agree(args: Any, config: ModelConfig) -> None:
    """A model argument stored beside `hf_config` must say what hf_config says: the model is built
    from hf_config, so an edited `args.rotary_base` (say) would otherwise be silently ignored."""
    layout = Layout(tokenizer={"tokenizer_type": _get(args, "tokenizer_type")})
    names = [*RESTATED, *(name for name, applies in RESTATED_IF.items() if applies(config))]
    for name in names:
        stored = _get(args, name)
        if stored is None:
            continue
        expected = FIELDS[name](config, layout)
        if name == "vocab_size" and _same(stored, config.vocab_size):
            continue  # NullTokenizer checkpoints hf_megatron wrote before following megatron-core's eod
        if not _same(stored, expected):
            raise ConfigError(f"args.{name}={stored!r} contradicts args.hf_config, which makes it {expected!r} "
                              f"(the model is built from hf_config); make them agree")


def config_from_args(args: Any, vocab_size: int | None = None) -> ModelConfig:
    """ModelConfig for a checkpoint's args (a Namespace, one of our stand-ins, or a dict)."""
    if args is None:
        raise ConfigError("checkpoint has no 'args'; cannot tell the architecture")
    divisible = _get(args, "make_vocab_size_divisible_by", 128) or 128
    hf_config = _get(args, "hf_config")
    if isinstance(hf_config, dict) and hf_config.get("model_type"):
        config = ModelConfig.from_hf(hf_config, make_vocab_size_divisible_by=divisible)
        check_args_agree(args, config)
        return config
    return ModelConfig.from_hf(hf_config_from_megatron_args(args, vocab_size), make_vocab_size_divisible_by=divisible)
