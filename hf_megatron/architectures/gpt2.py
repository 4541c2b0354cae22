"""GPT-2: LayerNorm with biases, learned absolute positions, GELU, tied embeddings (an untied
`lm_head.weight` where config.json says tie_word_embeddings=false, as GPT2LMHeadModel keeps it).

HF's GPT-2 uses Conv1D layers, whose weights are stored [in, out]: transposed to megatron-core's
Linear [out, in]; c_attn is one packed [q; k; v] tensor.
"""
from __future__ import annotations

from typing import Any

from ..config import ConfigError
from .base import IDENTITY, PACKED_QKV, TRANSPOSE, Architecture, MegatronArgs, Row, Transform

L, H = "decoder.layers.{i}.", "transformer.h.{i}."


def _weight_and_bias(mcore: str, hf: str, weight_transform: Transform = IDENTITY) -> tuple[Row, Row]:
    return Row(mcore + ".weight", hf + ".weight", weight_transform), Row(mcore + ".bias", hf + ".bias")


WEIGHTS = (
    Row("embedding.word_embeddings.weight", "transformer.wte.weight"),
    Row("embedding.position_embeddings.weight", "transformer.wpe.weight"),
    *_weight_and_bias(L + "input_layernorm", H + "ln_1"),
    Row(L + "self_attention.linear_qkv.weight", H + "attn.c_attn.weight", TRANSPOSE.then(PACKED_QKV)),
    Row(L + "self_attention.linear_qkv.bias", H + "attn.c_attn.bias", PACKED_QKV),
    *_weight_and_bias(L + "self_attention.linear_proj", H + "attn.c_proj", TRANSPOSE),
    *_weight_and_bias(L + "pre_mlp_layernorm", H + "ln_2"),
    *_weight_and_bias(L + "mlp.linear_fc1", H + "mlp.c_fc", TRANSPOSE),
    *_weight_and_bias(L + "mlp.linear_fc2", H + "mlp.c_proj", TRANSPOSE),
    *_weight_and_bias("decoder.final_layernorm", "transformer.ln_f"),
    Row("output_layer.weight", "lm_head.weight", when="not tie_word_embeddings"),
)

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _fields(data: dict[str, Any]) -> dict[str, Any]:
    act = data.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise ConfigError(f"gpt2 activation_function {act!r} is not supported; expected one of {sorted(_ACTIVATIONS)}")
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
        activation=_ACTIVATIONS[act],
        add_qkv_bias=True,
        add_proj_bias=True,
        add_mlp_bias=True,
        # GPT2LMHeadModel ties lm_head to wte unless the config says otherwise (transformers' default: tied)
        tie_word_embeddings=bool(data.get("tie_word_embeddings", True)),
        hidden_dropout=float(data.get("resid_pdrop", 0.0)),
        attention_dropout=float(data.get("attn_pdrop", 0.0)),
        embedding_dropout=float(data.get("embd_pdrop", 0.0)),
        init_method_std=data.get("initializer_range", 0.02),
        # scale_attn_weights=false: GPT2Attention's scaling is 1.0, not 1 / sqrt(head_dim)
        softmax_scale=None if data.get("scale_attn_weights", True) else 1.0,
    )


def _refuse_what_gpt2_lacks(args: MegatronArgs) -> None:
    """LayerNorm + learned positions is GPT-2, whose heads are hidden / heads wide, one key/value head
    per query head and no q/k norms: other values would be dropped, a different model trained."""
    head = args.hidden // args.heads
    kv_channels, groups = args.get("kv_channels"), args.get("num_query_groups")
    lacks = []
    if kv_channels is not None and kv_channels != head:
        lacks.append((f"kv_channels {kv_channels} (--kv-channels)", f"heads of {kv_channels} channels, GPT-2's are "
                      f"hidden / heads = {head}"))
    if args.get("group_query_attention") and groups not in (None, args.heads):
        lacks.append((f"num_query_groups {groups} (--group-query-attention --num-query-groups)",
                      f"{groups} key/value heads, GPT-2 has one per query head ({args.heads})"))
    if args.get("qk_layernorm"):
        lacks.append(("qk_layernorm (--qk-layernorm)", "a norm on each query and key head"))
    if lacks:
        what, would = lacks[0]
        raise ConfigError(f"GPT-2 family (LayerNorm + learned positions) has no {what}; Megatron-LM would build "
                          f"{would}: drop it, or use a family that has it (e.g. --normalization RMSNorm "
                          "--position-embedding-type rope --swiglu: Llama)")


def _from_megatron_args(args: MegatronArgs) -> dict[str, Any] | None:
    if not (args.normalization == "LayerNorm" and args.positions == "learned_absolute" and not args.swiglu):
        return None
    if not args.bias_linear:
        raise ConfigError("GPT-style checkpoint without linear biases (add_bias_linear=False) has no HF equivalent")
    _refuse_what_gpt2_lacks(args)
    return dict(vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.num_layers, n_head=args.heads,
                n_inner=args.ffn, n_positions=args.max_positions, layer_norm_epsilon=args.eps,
                activation_function="gelu_new" if args.get("openai_gelu") else "gelu",
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                tie_word_embeddings=not args.get("untie_embeddings_and_output_weights", False))


# the causal-mask buffers of older checkpoints (transformers' GPT2PreTrainedModel ignores attn.bias and
# crossattention.bias on load; transformers 4 listed attn.masked_bias as well)
UNUSED = (r"\.attn\.bias$", r"\.attn\.masked_bias$", r"\.crossattention\.bias$", r"\.crossattention\.masked_bias$")

GPT2 = Architecture("gpt2", ("GPT2LMHeadModel",), _fields, WEIGHTS, from_megatron_args=_from_megatron_args,
                    hf_unused=UNUSED)
