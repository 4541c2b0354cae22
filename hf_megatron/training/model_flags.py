"""Megatron-LM's model-shape flags for `hf-megatron train`: a fresh model without a config.json.

    hf-megatron train --num-layers 16 --hidden-size 2048 --num-attention-heads 32 \\
        --group-query-attention --num-query-groups 8 --ffn-hidden-size 8192 --swiglu \\
        --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \\
        --tokenizer-model gpt2 --data-path corpus_text_document --seq-length 2048 ...

The flags are Megatron-LM's (`pretrain_gpt.py`), with its defaults: LayerNorm, learned absolute
positions, linear biases, GeLU, ffn = 4 x hidden (with --swiglu: int(4 x hidden x 2/3 / 64) x 64),
kv_channels = hidden / heads, norm epsilon 1e-5, RoPE base 10000, tied embeddings, and hidden and
attention dropout 0.1 unless --hidden-dropout / --attention-dropout say otherwise.  As in a
Megatron checkpoint's args, the combination names the family (the same recognisers read both:
`hf_megatron.architectures.hf_config_from_megatron_args`): LayerNorm + learned positions = GPT-2;
RMSNorm + RoPE + SwiGLU = Llama (Qwen2 with --add-qkv-bias --disable-bias-linear, Qwen3 with
--qk-layernorm, Phi-3 with --rotary-percent < 1).  A combination no family has is one error.

Differences, each stated: --max-position-embeddings defaults to --seq-length (Megatron-LM requires
it); the vocabulary is --vocab-size, else the size of --tokenizer-model's tokenizer (Megatron-LM
takes it from its --tokenizer-type / --tokenizer-model; with --tokenizer-type NullTokenizer it is
N + 1 for --vocab-size N, as megatron-core's NullTokenizer adds its eod N), padded to a multiple
of 128 as the model's padded_vocab_size.  With NullTokenizer and no other model flag, --vocab-size is the
tokenizer's alone, as in Megatron-LM (the model is --hf-config / --hf-model / a checkpoint, whose
vocabulary must hold the N + 1 ids).  The model is then an ordinary transformers config: the
checkpoint records it, `convert megatron-to-hf` writes it, and a resumed run needs none of these
flags.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import null_tokenizer_eod
from ..errors import ConfigError
from .config_fields import flag_of, option

GROUP = "model (Megatron-LM's flags: a fresh model, instead of --hf-config)"
SHAPE = ("num_layers", "hidden_size", "num_attention_heads")  # Megatron-LM's required three
MEGATRON_DROPOUT = 0.1  # Megatron-LM's default --hidden-dropout and --attention-dropout


@dataclass(kw_only=True)
class ModelFlags:
    """The model-shape fields of RunConfig (one flag each, Megatron-LM's names and defaults)."""

    num_layers: int | None = option(None, group=GROUP, at_least=1, help="transformer layers")
    hidden_size: int | None = option(None, group=GROUP, at_least=1, help="hidden size")
    num_attention_heads: int | None = option(None, group=GROUP, at_least=1, help="attention heads")
    ffn_hidden_size: int | None = option(None, group=GROUP, at_least=1,
                                         help="MLP size (default: 4 x hidden; with --swiglu int(8 x hidden / 3 / "
                                              "64) x 64)")
    kv_channels: int | None = option(None, group=GROUP, at_least=1, help="head size (default: hidden / heads)")
    group_query_attention: bool = option(False, group=GROUP, help="grouped-query attention (--num-query-groups)")
    num_query_groups: int = option(1, group=GROUP, at_least=1, help="key/value heads with --group-query-attention")
    max_position_embeddings: int | None = option(None, group=GROUP, at_least=1,
                                                 help="positions (default: --seq-length)")
    position_embedding_type: str = option("learned_absolute", group=GROUP, choices=("learned_absolute", "rope"),
                                          help="position embedding")
    use_rotary_position_embeddings: bool = option(False, group=GROUP,
                                                  help="Megatron-LM's older spelling of --position-embedding-type rope")
    rotary_base: int = option(10000, group=GROUP, at_least=1, help="RoPE base (theta)")
    rotary_percent: float = option(1.0, group=GROUP, above=0.0, help="share of each head RoPE rotates")
    use_rope_scaling: bool = option(False, group=GROUP, help="Llama 3.1's RoPE scaling (low/high freq 1/4, "
                                                             "original context 8192)")
    rope_scaling_factor: float = option(8.0, group=GROUP, above=0.0, help="factor of --use-rope-scaling")
    normalization: str = option("LayerNorm", group=GROUP, choices=("LayerNorm", "RMSNorm"), help="norm layers")
    norm_epsilon: float = option(1e-5, group=GROUP, above=0.0, help="norm epsilon")
    swiglu: bool = option(False, group=GROUP, help="SwiGLU MLP (else GeLU)")
    openai_gelu: bool = option(False, group=GROUP, help="tanh-approximated GeLU (GPT-2's)")
    disable_bias_linear: bool = option(False, group=GROUP, help="no biases in the linear layers")
    add_qkv_bias: bool = option(False, group=GROUP, help="biases in the QKV projection (with "
                                                         "--disable-bias-linear: Qwen2)")
    qk_layernorm: bool = option(False, group=GROUP, help="RMSNorm on each query and key head (Qwen3)")
    untie_embeddings_and_output_weights: bool = option(False, group=GROUP,
                                                       help="an output layer of its own (default: tied)")
    vocab_size: int | None = option(None, group=GROUP, at_least=1,
                                    help="vocabulary (default: the size of --tokenizer-model's tokenizer); with "
                                         "--tokenizer-type NullTokenizer N + 1 rows, its eod being id N (beside --hf-config / "
                                         "--hf-model: the NullTokenizer's size only, N + 1 within the model's)")

    def _flags_set(self) -> list[str]:
        defaults = ModelFlags.__dataclass_fields__
        return [name for name in defaults if getattr(self, name) != defaults[name].default]

    def null_tokenizer_vocab_size(self) -> int | None:
        """--vocab-size N when, as in Megatron-LM, it only sizes --tokenizer-type NullTokenizer (ids 0..N-1,
        eod N): no other model flag is given, so the model comes from --hf-config / --hf-model / a checkpoint,
        whose vocabulary must hold the N + 1 ids (preflight.check_null_tokenizer_fits); else None."""
        if getattr(self, "tokenizer_type", None) == "NullTokenizer" and self._flags_set() == ["vocab_size"]:
            return self.vocab_size
        return None

    def model_flags_given(self) -> list[str]:
        """The model flags set away from their defaults, as flags (not a NullTokenizer's lone --vocab-size)."""
        return [] if self.null_tokenizer_vocab_size() else [flag_of(name) for name in self._flags_set()]

    def check_model_flags(self) -> bool:
        """True when the model comes from these flags; one-line ConfigError when they are incomplete or
        come with another source of the model."""
        given = self.model_flags_given()
        if not given:
            return False
        missing = [f"--{n.replace('_', '-')}" for n in SHAPE if getattr(self, n) is None]
        if missing:
            raise ConfigError(f"RunConfig: the model flags {', '.join(given)} need {', '.join(missing)} as well "
                              "(Megatron-LM's model shape), or drop them and give --hf-model / --hf-config")
        other = [f for f, v in (("--hf-model", self.hf_model), ("--hf-config", self.hf_config)) if v]
        if other:
            raise ConfigError(f"RunConfig: {other[0]} and the model flags ({', '.join(given)}) both define the "
                              "model; give one")
        if self.hidden_size % self.num_attention_heads and self.kv_channels is None:
            raise ConfigError(f"RunConfig.hidden_size (--hidden-size): expected a multiple of --num-attention-heads "
                              f"{self.num_attention_heads} (or --kv-channels), got {self.hidden_size}")
        if self.group_query_attention and self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"RunConfig.num_query_groups (--num-query-groups): expected a divisor of "
                              f"--num-attention-heads {self.num_attention_heads}, got {self.num_query_groups}")
        return True

    def megatron_args(self, seq_length: int, vocab_size: int | None) -> dict[str, Any]:
        """These flags as Megatron-LM's args after its validate_args (its defaults filled in)."""
        ffn = self.ffn_hidden_size
        if ffn is None:
            ffn = int((4 * self.hidden_size * 2 / 3) / 64) * 64 if self.swiglu else 4 * self.hidden_size
        # megatron-core's NullTokenizer: --vocab-size N gives ids 0..N-1 and its eod N
        vocab = self.vocab_size + null_tokenizer_eod(getattr(self, "tokenizer_type", None)) if self.vocab_size \
            else vocab_size
        if not vocab:
            raise ConfigError("RunConfig.vocab_size (--vocab-size): the model flags need the vocabulary: give "
                              "--vocab-size N or --tokenizer-model with a tokenizer")
        rope = self.use_rotary_position_embeddings or self.position_embedding_type == "rope"
        return dict(num_layers=self.num_layers, hidden_size=self.hidden_size, ffn_hidden_size=ffn,
                    num_attention_heads=self.num_attention_heads, kv_channels=self.kv_channels,
                    group_query_attention=self.group_query_attention, num_query_groups=self.num_query_groups,
                    max_position_embeddings=self.max_position_embeddings or seq_length,
                    position_embedding_type="rope" if rope else "learned_absolute",
                    rotary_base=self.rotary_base, rotary_percent=self.rotary_percent,
                    use_rope_scaling=self.use_rope_scaling, rope_scaling_factor=self.rope_scaling_factor,
                    normalization=self.normalization, norm_epsilon=self.norm_epsilon, swiglu=self.swiglu,
                    openai_gelu=self.openai_gelu, add_bias_linear=not self.disable_bias_linear,
                    add_qkv_bias=self.add_qkv_bias, qk_layernorm=self.qk_layernorm,
                    untie_embeddings_and_output_weights=self.untie_embeddings_and_output_weights,
                    vocab_size=vocab)


# Megatron-LM argument -> the flag that sets it, the model-defining ones (check_checkpoint_args asserts
# the first three), in the order a contradiction is reported (derived ones, as kv_channels, after
# what they derive from)
DEFINING = {"num_layers": "--num-layers", "hidden_size": "--hidden-size",
            "num_attention_heads": "--num-attention-heads", "group_query_attention": "--group-query-attention",
            "num_query_groups": "--num-query-groups", "kv_channels": "--kv-channels",
            "normalization": "--normalization", "position_embedding_type": "--position-embedding-type",
            "swiglu": "--swiglu", "openai_gelu": "--openai-gelu", "add_bias_linear": "--disable-bias-linear",
            "add_qkv_bias": "--add-qkv-bias", "qk_layernorm": "--qk-layernorm",
            "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
            "vocab_size": "--vocab-size", "ffn_hidden_size": "--ffn-hidden-size", "norm_epsilon": "--norm-epsilon",
            "rotary_percent": "--rotary-percent", "max_position_embeddings": "--max-position-embeddings",
            "rotary_base": "--rotary-base", "use_rope_scaling": "--use-rope-scaling",
            "rope_scaling_factor": "--rope-scaling-factor"}
ROPE_ONLY = ("rotary_percent", "rotary_base", "use_rope_scaling", "rope_scaling_factor")
# what a fine-tune may change (context extension), as Megatron-LM checks no args with --finetune
FINETUNE_MAY_CHANGE = ("max_position_embeddings", "rotary_base", "use_rope_scaling", "rope_scaling_factor")


def _same_padded_vocab(flags_config, checkpoint_config) -> bool:
    """A Megatron-LM checkpoint knows only its padded vocabulary (args.padded_vocab_size, as
    check_checkpoint_args compares): the flags' vocabulary padded alike must give it."""
    padded = checkpoint_config.padded_vocab_size()
    divisor = max(1, checkpoint_config.make_vocab_size_divisible_by)
    return checkpoint_config.vocab_size == padded and -(-flags_config.vocab_size // divisor) * divisor == padded


def check_flags_match_checkpoint(flags_config, checkpoint_config, folder, resume: bool,
                                 given_by: str | None = None) -> None:
    """One-line ConfigError at the first model-defining value the model flags (or the config file
    `given_by`, e.g. "--hf-config <path>") give otherwise than the checkpoint whose weights the run
    loads (a same-shaped contradiction, as 8 heads for 4 -- qkv keeps its shape -- would otherwise load
    and train another model)."""
    from ..checkpoint.args import FIELDS, Layout
    layout = Layout(tokenizer={})  # vocab_size compared as the model's vocabulary, whatever the tokenizer
    rope = "rope" in (flags_config.position_embedding_type, checkpoint_config.position_embedding_type)
    for name, flag in DEFINING.items():
        if (name in ROPE_ONLY and not rope) or (not resume and name in FINETUNE_MAY_CHANGE):
            continue
        given, saved = FIELDS[name](flags_config, layout), FIELDS[name](checkpoint_config, layout)
        if given != saved and not (name == "vocab_size" and _same_padded_vocab(flags_config, checkpoint_config)):
            source, fix = ((f"{given_by} makes it {given}", "drop --hf-config or give it the checkpoint's values")
                           if given_by else (f"the model flags make it {given} ({flag})",
                                             "drop the model flags or give its values"))
            raise ConfigError(f"--load {folder}: the checkpoint's {name} is {saved}, {source}; the checkpoint defines "
                              f"the model: {fix}")


def hf_config_of_flags(run, vocab_size: int | None) -> dict[str, Any]:
    """The transformers config dict the model flags of `run` describe (one-line ConfigError if no
    supported family has that combination)."""
    from ..architectures import hf_config_from_megatron_args
    args = run.megatron_args(run.seq_length, vocab_size)
    return hf_config_from_megatron_args(args, args["vocab_size"], what="the model flags' architecture")
