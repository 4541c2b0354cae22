"""Architecture records: one table per family, both mapping directions derived from it."""
import argparse
import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import hf_megatron
from hf_megatron import ConfigError, GPTModel, ModelConfig, architectures
from hf_megatron.loading import build_model
from hf_megatron.parallel.sharding import load_full_weights
from hf_megatron.architectures import base
from hf_megatron.architectures.base import (FUSE_QKV, GATE_UP, IDENTITY, PACKED_QKV, TRANSPOSE, Architecture,
                                            MegatronArgs, Row)
from hf_megatron.checkpoint import args as megatron_args
from hf_megatron.checkpoint.args import config_from_args
from tiny import tiny_config, tiny_hf_model

FAMILIES = [("gpt2", {}), ("llama", {}), ("mistral", {}), ("qwen2", {}), ("qwen3", {}),
            ("llama", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True, num_key_value_heads=4))]
IDS = ["gpt2", "llama", "mistral", "qwen2", "qwen3", "llama-biased-tied-mha"]


def _hf_state(arch, **overrides):
    model = tiny_hf_model(arch, **overrides)
    state = {n: t.detach() for n, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return ModelConfig.from_hf(model.config), state


@pytest.mark.parametrize("arch,overrides", FAMILIES, ids=IDS)
def test_hf_to_mcore_to_hf_is_bit_identical_and_name_complete(arch, overrides):
    config, hf_state = _hf_state(arch, **overrides)
    mcore = dict(architectures.hf_to_mcore(hf_state.__getitem__, config))
    back = dict(architectures.mcore_to_hf(mcore.__getitem__, config))
    assert back.keys() == hf_state.keys()
    for name, tensor in back.items():
        assert tensor.dtype == hf_state[name].dtype and torch.equal(tensor, hf_state[name]), name
    # the megatron-core side is what GPTModel holds (tied output layer aside)
    expected = set(GPTModel(config, device="meta").state_dict()) - (
        {"output_layer.weight"} if config.tie_word_embeddings else set())
    assert set(mcore) == expected


def _recorded(direction, config, source_shapes):
    """Run one direction on meta tensors, recording which source names made each output name."""
    asked: list[str] = []
    yielded = [False]  # the names asked since the last output made the next outputs

    def get(name):
        if yielded[0]:
            asked.clear()
            yielded[0] = False
        asked.append(name)
        return torch.empty(source_shapes[name], device="meta")

    made = {}
    for name, tensor in direction(get, config):
        assert tensor.device.type == "meta"
        made[name] = (tuple(asked), tensor.shape)
        yielded[0] = True
    return made


@pytest.mark.parametrize("arch,overrides", FAMILIES, ids=IDS)
def test_both_directions_are_the_table(arch, overrides):
    """Each direction reads exactly a row's source names and writes its target names, with the
    shapes the real tensors have -- also on meta tensors (shape planning)."""
    config, hf_state = _hf_state(arch, **overrides)
    table = list(base.expand(architectures.get(arch).weights, config))
    to_mcore = _recorded(architectures.hf_to_mcore, config, {n: t.shape for n, t in hf_state.items()})
    assert [(m, to_mcore[m][0]) for m, _, _ in table] == [(m, hf) for m, hf, _ in table]
    to_hf = _recorded(architectures.mcore_to_hf, config, {m: shape for m, (_, shape) in to_mcore.items()})
    assert {h: asked for h, (asked, _) in to_hf.items()} == {h: (m,) for m, hfs, _ in table for h in hfs}
    assert {h: shape for h, (_, shape) in to_hf.items()} == {n: t.shape for n, t in hf_state.items()}


@pytest.mark.parametrize("transform,arity", [(IDENTITY, 1), (TRANSPOSE, 1), (FUSE_QKV, 3), (GATE_UP, 2),
                                             (PACKED_QKV, 1), (TRANSPOSE.then(PACKED_QKV), 1)],
                         ids=lambda x: getattr(x, "name", str(x)))
def test_each_transform_inverts_exactly(transform, arity):
    config = ModelConfig(model_type="llama", vocab_size=32, hidden_size=64, num_layers=1, num_attention_heads=8,
                         num_query_groups=2, ffn_hidden_size=96)
    qkv_rows = [8 * 8, 2 * 8, 2 * 8]
    if transform is FUSE_QKV:
        hf = tuple(torch.randn(rows, 64) for rows in qkv_rows)
    elif transform.name.endswith("unpack_qkv+fuse_qkv"):
        hf = (torch.randn(sum(qkv_rows), 64),)
        if transform.name.startswith("transpose"):
            hf = (hf[0].t().contiguous(),)
    else:
        hf = tuple(torch.randn(96, 64) for _ in range(arity))
    (mcore,) = transform.to_mcore(hf, config)
    back = transform.to_hf((mcore,), config)
    assert len(back) == arity and all(torch.equal(a, b) and a.is_contiguous() for a, b in zip(back, hf))


def test_fused_qkv_is_laid_out_per_query_group():
    config = ModelConfig(model_type="llama", vocab_size=32, hidden_size=8, num_layers=1, num_attention_heads=4,
                         num_query_groups=2, kv_channels=1, ffn_hidden_size=8)
    q, k, v = torch.arange(4.0), torch.arange(10.0, 12.0), torch.arange(20.0, 22.0)
    (fused,) = FUSE_QKV.to_mcore((q, k, v), config)
    assert fused.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]  # [q heads of g; k_g; v_g] per group g


def test_unknown_model_type_and_unsupported_fields_are_one_line_config_errors():
    with pytest.raises(ConfigError, match=r"^unsupported model_type 'bert'; supported: gemma2, gemma3_text, gpt2, llama, mistral, olmo2, phi3, qwen2, qwen3$"):
        architectures.get("bert")
    with pytest.raises(ConfigError, match=r"^unsupported model_type 'bert'"):
        architectures.plan_for(dataclasses.replace(ModelConfig.from_hf(tiny_config("llama")), model_type="bert"))
    bad_inputs = [("gpt2", dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn=True is not supported"),
                  ("gpt2", dict(activation_function="relu"), "activation_function 'relu' is not supported"),
                  ("llama", dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported for llama"),
                  ("qwen2", dict(use_sliding_window=True), "use_sliding_window=True is not supported")]
    for arch, overrides, message in bad_inputs:
        data = {**tiny_config(arch).to_dict(), **overrides}
        with pytest.raises(ConfigError, match=message) as error:
            ModelConfig.from_hf(data)
        assert "\n" not in str(error.value)


def test_hf_class_names():
    assert [architectures.hf_class_name(t) for t in ("gpt2", "llama", "mistral", "qwen2")] == [
        "GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"]
    assert architectures.plan_for(ModelConfig.from_hf(tiny_config("qwen2"))) == architectures.gpt_plan(
        ModelConfig.from_hf(tiny_config("qwen2")))


# --------------------------------------------------------------- Megatron-LM flags -> HF config


def _megatron_args(arch, **overrides):
    args = vars(megatron_args.build_args(ModelConfig.from_hf(tiny_config(arch, **overrides)), tp=2))
    args.pop("hf_config")  # as Megatron-LM writes them: only its own flags
    return args


FIELDS = ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
          "vocab_size", "max_position_embeddings", "position_embedding_type", "normalization", "norm_epsilon",
          "activation", "add_qkv_bias", "add_proj_bias", "add_mlp_bias", "tie_word_embeddings", "rotary_base")


@pytest.mark.parametrize("arch,overrides,vocab_size", [
    ("gpt2", {}, None), ("gpt2", dict(activation_function="gelu"), 300), ("llama", {}, None),
    ("llama", dict(attention_bias=True, mlp_bias=True, rope_scaling=None), None), ("qwen2", {}, 300),
    ("mistral", {}, None)])
def test_megatron_flags_alone_give_back_the_architecture(arch, overrides, vocab_size):
    """Args as Megatron-LM writes them (no hf_config) -> a ModelConfig equal to the one the args
    were written from, field by field (Mistral's window is not a flag we read: it reads as llama)."""
    original = ModelConfig.from_hf(tiny_config(arch, **overrides))
    args = _megatron_args(arch, **overrides)
    for given in (args, argparse.Namespace(**args)):
        recognised = config_from_args(given, vocab_size)
        assert recognised.model_type == ("llama" if arch == "mistral" else arch)
        for field in FIELDS:
            assert getattr(recognised, field) == getattr(original, field), (arch, field)


@pytest.mark.parametrize("change,message", [
    (dict(num_layers=None), "lack num_layers"), (dict(vocab_size=None, padded_vocab_size=None), "padded_vocab_size"),
    (dict(add_bias_linear=False), "add_bias_linear=False"), (dict(normalization="RMSNorm"), "matches none of")])
def test_unrecognisable_megatron_args_are_one_line_errors(change, message):
    args = {**_megatron_args("gpt2"), **change}
    with pytest.raises(ConfigError, match=message) as error:
        architectures.hf_config_from_megatron_args(args)
    assert "\n" not in str(error.value)


# --------------------------------------------------------------- a new family is one record

L, H = "decoder.layers.{i}.", "model.layers.{i}."
TOY_WEIGHTS = (  # phi3-style names: one packed [q; k; v] and one [gate; up] tensor per layer
    Row("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    Row(L + "input_layernorm.weight", H + "input_layernorm.weight"),
    Row(L + "self_attention.linear_qkv.weight", H + "self_attn.qkv_proj.weight", PACKED_QKV),
    Row(L + "self_attention.linear_proj.weight", H + "self_attn.o_proj.weight"),
    Row(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight"),
    Row(L + "mlp.linear_fc1.weight", H + "mlp.gate_up_proj.weight"),
    Row(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight"),
    Row("decoder.final_layernorm.weight", "model.norm.weight"),
    Row("output_layer.weight", "lm_head.weight", when="not tie_word_embeddings"),
)


def _toy_fields(data):
    return dict(vocab_size=data["vocab_size"], hidden_size=data["hidden_size"], num_layers=data["num_hidden_layers"],
                num_attention_heads=data["num_attention_heads"], num_query_groups=data["num_key_value_heads"],
                ffn_hidden_size=data["intermediate_size"], max_position_embeddings=32, rotary_base=1e4)


def _toy_from_args(args: MegatronArgs):
    if args.normalization == "RMSNorm" and args.positions == "rope" and not args.swiglu:
        return dict(vocab_size=args.vocab, hidden_size=args.hidden)
    return None


TOY = Architecture("toy", ("ToyForCausalLM",), _toy_fields, TOY_WEIGHTS, from_megatron_args=_toy_from_args)


def test_a_new_family_is_one_record(monkeypatch):
    monkeypatch.setitem(architectures.REGISTRY, "toy", TOY)
    config = ModelConfig.from_hf(dict(model_type="toy", vocab_size=100, hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=96))
    assert architectures.hf_class_name("toy") == "ToyForCausalLM" and "toy" in architectures.SUPPORTED
    toy_args = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, normalization="RMSNorm",
                    position_embedding_type="rope", swiglu=False)  # no built-in family claims these flags
    assert architectures.hf_config_from_megatron_args(toy_args) == dict(
        model_type="toy", architectures=["ToyForCausalLM"], vocab_size=100, hidden_size=64)
    torch.manual_seed(0)
    model = build_model(config, seed=3).eval()
    mcore = {n: t.detach() for n, t in model.state_dict().items()}
    hf = dict(architectures.mcore_to_hf(mcore.__getitem__, config))
    assert hf["model.layers.1.self_attn.qkv_proj.weight"].shape == (64 + 2 * 2 * 16, 64)
    assert hf["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 96, 64)
    back = dict(architectures.hf_to_mcore(hf.__getitem__, config))
    assert back.keys() == mcore.keys() and all(torch.equal(back[n], mcore[n]) for n in mcore)
    again = build_model(config, init=False).eval()
    load_full_weights(again, back.items())
    ids = torch.randint(0, 100, (1, 8))
    assert torch.equal(again(ids).logits, model(ids).logits)


def test_a_row_names_only_config_flags_and_layers_consistently():
    with pytest.raises(ValueError, match="names no ModelConfig field"):
        Row("a.weight", "b.weight", when="has_bias")
    with pytest.raises(ValueError, match=r"'\{i\}' must be in"):
        Row("decoder.layers.{i}.a.weight", "b.weight")
    with pytest.raises(ValueError, match="in more than one row"):
        Architecture("dup", ("X",), _toy_fields, (Row("a", "b"), Row("c", "b")))


# --------------------------------------------------------------- layering


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_config_is_below_architectures_and_architectures_below_the_rest():
    package = Path(hf_megatron.__file__).parent
    assert not any("architectures" in name for name in _imports(package / "config.py"))
    for path in (package / "architectures").glob("*.py"):
        upward = {n for n in _imports(path) if n.startswith("..") and n not in ("..", "..config", "..errors")}
        assert not upward, f"{path.name} imports {upward}"
