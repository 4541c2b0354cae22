"""Every converter and loader checks each tensor's presence and shape against the config before
it reads or writes anything: one CheckpointError line naming the file and the tensor, expected vs
found.  (Before: a wrong embedding shape round-tripped with exit 0; reshard dropped a missing
tensor.)"""
from __future__ import annotations

import shutil

import pytest
import torch

import hf_megatron
from hf_megatron.checkpoint.load import load_megatron_weights, open_megatron
from hf_megatron.cli import main
from hf_megatron.conversion.convert import hf_to_megatron, megatron_to_hf, reshard
from hf_megatron.errors import CheckpointError
from hf_megatron.loading import build_model
from hf_megatron.parallel import state
from bad_checkpoints import edit_rank_file, edit_safetensors, rank_file, write_torch_dist
from test_convert_helpers import hf_sources  # noqa: F401

EMBED = "model.embed_tokens.weight"


@pytest.fixture
def llama(hf_sources, tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(hf_sources["llama"], folder)
    return folder


@pytest.fixture(scope="module")
def megatron_tp2(hf_sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("m") / "tp2"
    hf_to_megatron(hf_sources["llama"], out, tp=2)
    return out


def _copy(src, tmp_path):
    shutil.copytree(src, tmp_path / "meg")
    return tmp_path / "meg"


def test_hf_wrong_embedding_shape_is_refused_by_converter_cli_and_from_pretrained(llama, tmp_path, capsys):
    path = edit_safetensors(llama, lambda t: t.__setitem__(EMBED, t[EMBED][:299].clone()))
    with pytest.raises(CheckpointError) as err:
        hf_to_megatron(llama, tmp_path / "out")
    message = str(err.value)
    assert str(path) in message and EMBED in message and "(299, 64)" in message and "(300, 64)" in message
    assert not (tmp_path / "out").exists()
    assert main(["convert", "hf-to-megatron", "--hf", str(llama), "--out", str(tmp_path / "out")]) == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1 and EMBED in line and "expected (300, 64)" in line
    state.reset()
    with pytest.raises(CheckpointError, match="expected \\(300, 64\\)"):
        hf_megatron.from_pretrained(llama)


@pytest.mark.parametrize("damage,fragment", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "'model.layers.1.mlp.up_proj.weight' missing"),
    (lambda t: t.__setitem__("model.norm.weight", torch.ones(64, dtype=torch.int32)), "dtype int32"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 64)),
     "'model.layers.0.self_attn.k_proj.weight' has shape (64, 64), expected (32, 64)"),
])
def test_hf_missing_tensor_or_wrong_dtype_is_refused(damage, fragment, llama, tmp_path):
    edit_safetensors(llama, damage)
    with pytest.raises(CheckpointError, match="^" + str(llama).replace(".", "\\.")) as err:
        hf_to_megatron(llama, tmp_path / "out")
    assert fragment in str(err.value)


def test_a_transformers_model_object_is_checked_too():
    from tiny import tiny_hf_model
    model = tiny_hf_model("gpt2")
    model.transformer.wpe.weight = torch.nn.Parameter(torch.zeros(32, 64))
    state.reset()
    with pytest.raises(CheckpointError, match="the given model: tensor 'transformer.wpe.weight' has shape \\(32, 64\\)"):
        hf_megatron.from_pretrained(model)


def test_rank_file_missing_a_tensor_stops_every_reader(megatron_tp2, tmp_path, capsys):
    """One TP rank lacks a tensor: megatron-to-hf, reshard and load_megatron_weights all refuse."""
    root = _copy(megatron_tp2, tmp_path)
    bad = edit_rank_file(rank_file(root, tp_rank=1), lambda m: m.pop("decoder.layers.1.mlp.linear_fc2.weight"))
    for run in (lambda: megatron_to_hf(root, tmp_path / "hf"), lambda: reshard(root, tmp_path / "r", tp=1)):
        with pytest.raises(CheckpointError) as err:
            run()
        assert str(bad) in str(err.value) and "'decoder.layers.1.mlp.linear_fc2.weight' missing" in str(err.value)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "r").exists()
    assert main(["reshard", "--src", str(root), "--out", str(tmp_path / "r"), "--tp", "1"]) == 2
    assert "linear_fc2.weight' missing" in capsys.readouterr().err


def test_a_tensor_missing_from_every_rank_is_an_error_not_dropped(megatron_tp2, tmp_path):
    root = _copy(megatron_tp2, tmp_path)
    for t in range(2):
        edit_rank_file(rank_file(root, tp_rank=t), lambda m: m.pop("decoder.layers.0.input_layernorm.weight"))
    with pytest.raises(CheckpointError, match="'decoder.layers.0.input_layernorm.weight' missing; the checkpoint's args"):
        reshard(root, tmp_path / "r", tp=1)
    assert not (tmp_path / "r").exists()


def test_wrong_shard_shape_names_the_rank_file(megatron_tp2, tmp_path):
    root = _copy(megatron_tp2, tmp_path)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"  # tp2 shard: (2 groups x (2+2) x 16) / 2 rows
    bad = edit_rank_file(rank_file(root, tp_rank=1), lambda m: m.__setitem__(name, m[name][:-1].clone()))
    with pytest.raises(CheckpointError) as err:
        open_megatron(root)
    assert str(bad) in str(err.value) and f"{name!r} has shape (63, 64), expected (64, 64)" in str(err.value)


def test_load_megatron_weights_checks_shapes(megatron_tp2, tmp_path):
    root = _copy(megatron_tp2, tmp_path)
    edit_rank_file(rank_file(root, tp_rank=0), lambda m: m.__setitem__("decoder.final_layernorm.weight", torch.ones(63)))
    state.reset()
    model = build_model(open_megatron(megatron_tp2).config, init=False)
    with pytest.raises(CheckpointError, match="'decoder.final_layernorm.weight' has shape \\(63,\\), expected \\(64,\\)"):
        load_megatron_weights(model, root)


def test_an_extra_model_tensor_the_config_has_no_place_for_is_refused(megatron_tp2, tmp_path):
    root = _copy(megatron_tp2, tmp_path)
    edit_rank_file(rank_file(root, tp_rank=0), lambda m: m.__setitem__("decoder.layers.1.mlp.linear_fc1.bias", torch.ones(64)))
    with pytest.raises(CheckpointError, match="'decoder.layers.1.mlp.linear_fc1.bias' is not part of the model"):
        open_megatron(root)


def test_torch_dist_entry_of_wrong_shape(megatron_tp2, tmp_path):
    reader = open_megatron(megatron_tp2)
    full = reader.full_state_dict()
    full["decoder.layers.0.pre_mlp_layernorm.weight"] = torch.ones(65)
    full["decoder.layers.1.pre_mlp_layernorm.weight"] = torch.ones(65)
    root = write_torch_dist(full, reader.args, tmp_path / "dist", num_layers=2)
    with pytest.raises(CheckpointError, match="'decoder.layers.pre_mlp_layernorm.weight\\[0\\]' has shape \\(65,\\), "
                                              "expected \\(64,\\)"):
        megatron_to_hf(root, tmp_path / "hf")
    full.pop("decoder.final_layernorm.weight")
    full["decoder.layers.0.pre_mlp_layernorm.weight"] = full["decoder.layers.1.pre_mlp_layernorm.weight"] = torch.ones(64)
    root = write_torch_dist(full, reader.args, tmp_path / "dist2", num_layers=2)
    with pytest.raises(CheckpointError, match="'decoder.final_layernorm.weight' missing"):
        megatron_to_hf(root, tmp_path / "hf")
