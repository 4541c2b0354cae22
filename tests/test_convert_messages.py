"""Conversion errors say what is actually wrong: a stray rank folder is named (not reported as a
layout nobody wrote), a layer-count conflict names the field it comes from, an unsupported value is
not called a wrong type, and an --out that is a file is called a file."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from hf_megatron.checkpoint.checksums import sidecar
from hf_megatron.checkpoint.unpickle import safe_load
from hf_megatron.cli import main
from test_convert_helpers import cli_fails, save_hf


def _megatron(tmp_path, arch="gpt2", *flags):
    src = save_hf(tmp_path / "hf", arch)
    meg = tmp_path / "meg"
    assert main(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(meg), *flags]) == 0
    return src, meg


def _edit_args(meg, edit):
    for rank_file in (meg / "release").glob("*/model_optim_rng.pt"):
        payload = safe_load(rank_file)
        edit(payload["args"])
        torch.save(payload, rank_file)
        sidecar(rank_file).unlink(missing_ok=True)


def test_a_stray_rank_folder_is_named(tmp_path, capsys):
    _, meg = _megatron(tmp_path, "gpt2", "--tp", "2")
    shutil.copytree(meg / "release/mp_rank_01", meg / "release/mp_rank_02")
    err = cli_fails(["convert", "megatron-to-hf", "--megatron", str(meg), "--out", str(tmp_path / "o")], capsys,
                    str(meg / "release/mp_rank_02"), "unexpected rank folder", "tp=2, pp=1")
    assert "tp=3" not in err
    (meg / "release/mp_rank_02/model_optim_rng.pt").unlink()  # an empty stray folder: the same
    err = cli_fails(["reshard", "--src", str(meg), "--out", str(tmp_path / "o"), "--tp", "1"], capsys,
                    str(meg / "release/mp_rank_02"), "unexpected rank folder")
    assert "tp=3" not in err and "missing" not in err
    shutil.rmtree(meg / "release/mp_rank_02")
    shutil.rmtree(meg / "release/mp_rank_01")  # a missing one is named as missing, with the args' layout
    cli_fails(["convert", "megatron-to-hf", "--megatron", str(meg), "--out", str(tmp_path / "o")], capsys,
              str(meg / "release/mp_rank_01/model_optim_rng.pt"), "missing", "checkpoint args say tp=2, pp=1")


def test_layer_count_conflict_names_hf_config(tmp_path, capsys):
    _, meg = _megatron(tmp_path, "gpt2")
    _edit_args(meg, lambda args: args.hf_config.update(n_layer=3))
    # args.num_layers (2) now contradicts hf_config: that is said first, naming both
    cli_fails(["convert", "megatron-to-hf", "--megatron", str(meg), "--out", str(tmp_path / "o")], capsys,
              "args.num_layers=2 contradicts args.hf_config, which makes it 3")
    _edit_args(meg, lambda args: setattr(args, "num_layers", None))  # as if absent: the files disagree with hf_config
    err = cli_fails(["convert", "megatron-to-hf", "--megatron", str(meg), "--out", str(tmp_path / "o")], capsys,
                    "holds 2 layers", "args.hf_config says n_layer=3")
    assert "num_layers=3" not in err


def test_unsupported_value_is_not_called_a_wrong_type(tmp_path, capsys):
    src = save_hf(tmp_path / "hf", "gpt2")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "activation_function": "relu"}))
    err = cli_fails(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "o")], capsys,
                    str(src / "config.json"), "activation_function 'relu' is not supported")
    assert "wrong type" not in err
    (src / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": [1e-5]}))  # this one is
    cli_fails(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "o")], capsys,
              str(src / "config.json"), "norm_epsilon")


def test_out_that_is_a_file_is_called_a_file(tmp_path, capsys):
    src = save_hf(tmp_path / "hf", "gpt2")
    (tmp_path / "taken").write_text("my notes")
    err = cli_fails(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "taken")], capsys,
                    str(tmp_path / "taken"), "is a file")
    assert "not empty" not in err and (tmp_path / "taken").read_text() == "my notes"


@pytest.mark.parametrize("field,value,expected", [("rotary_base", 1000000.0, "500000.0"),
                                                  ("norm_epsilon", 1e-3, "1e-06"),
                                                  ("num_layers", 3, "2")])
def test_args_that_contradict_hf_config_are_refused(field, value, expected, tmp_path, capsys):
    """The model is built from args.hf_config; an args field saying otherwise is not silently ignored."""
    _, meg = _megatron(tmp_path, "llama", "--tp", "2")
    _edit_args(meg, lambda args: setattr(args, field, value))
    for argv in (["convert", "megatron-to-hf", "--megatron", str(meg)], ["reshard", "--src", str(meg)]):
        cli_fails(argv + ["--out", str(tmp_path / "o")], capsys, f"args.{field}={value!r}", expected, "hf_config",
                  "model_optim_rng.pt")
        assert not (tmp_path / "o").exists()


def test_args_that_agree_with_hf_config_in_another_spelling_pass(tmp_path, capsys):
    _, meg = _megatron(tmp_path, "llama")
    _edit_args(meg, lambda args: setattr(args, "rotary_base", 500000))  # an int, as Megatron-LM's flag stores it
    assert main(["convert", "megatron-to-hf", "--megatron", str(meg), "--out", str(tmp_path / "o")]) == 0
