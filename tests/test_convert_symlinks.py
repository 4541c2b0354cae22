"""A folder handed to `convert` / `from_pretrained` / `reshard` may hold symlinks within itself, never
ones leading out of it (a config.json, weights file, rank file, tracker or tokenizer folder that is a
link to elsewhere): one line naming the path, nothing written."""
from __future__ import annotations

import shutil

import pytest

import hf_megatron
from hf_megatron.cli import main
from hf_megatron.errors import CheckpointError
from test_convert_helpers import assert_identical, cli_fails, hf_tensors, save_hf


@pytest.fixture()
def outside(tmp_path):
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    return folder


def _link_out(folder, name, outside):
    """Move `folder/name` out of the folder and leave a symlink to it."""
    target = outside / name.replace("/", "_")
    shutil.move(folder / name, target)
    (folder / name).symlink_to(target, target_is_directory=target.is_dir())
    return folder / name


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "generation_config.json"])
def test_hf_files_linked_out_of_the_folder_are_refused(name, tmp_path, outside, capsys):
    src = save_hf(tmp_path / "hf", "llama")
    link = _link_out(src, name, outside)
    cli_fails(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "o")], capsys,
              str(link), "a symlink to", "outside")
    assert not (tmp_path / "o").exists()
    if name != "generation_config.json":  # from_pretrained reads no generation config
        with pytest.raises(CheckpointError, match="outside"):
            hf_megatron.from_pretrained(src)


def test_pytorch_bin_linked_out_of_the_folder_is_refused(tmp_path, outside, capsys):
    import torch
    src = save_hf(tmp_path / "hf", "gpt2")
    torch.save(hf_tensors(src), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    link = _link_out(src, "pytorch_model.bin", outside)
    cli_fails(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "o")], capsys, str(link),
              "outside")


def test_symlinks_within_the_folder_are_fine(tmp_path, capsys):
    src = save_hf(tmp_path / "hf", "gpt2")
    (src / "weights").mkdir()
    shutil.move(src / "model.safetensors", src / "weights/real.safetensors")
    (src / "model.safetensors").symlink_to("weights/real.safetensors")
    meg = tmp_path / "meg"
    assert main(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(meg)]) == 0
    shutil.move(meg / "release", meg / "stored_release")
    (meg / "release").symlink_to("stored_release", target_is_directory=True)
    assert main(["convert", "megatron-to-hf", "--megatron", str(meg), "--out", str(tmp_path / "back")]) == 0
    assert_identical(hf_tensors(src), hf_tensors(tmp_path / "back"))


@pytest.mark.parametrize("name", ["latest_checkpointed_iteration.txt", "release/mp_rank_01/model_optim_rng.pt",
                                  "release/mp_rank_00", "release", "tokenizer"])
def test_megatron_paths_linked_out_of_the_folder_are_refused(name, tmp_path, outside, capsys):
    src = save_hf(tmp_path / "hf", "llama")
    meg = tmp_path / "meg"
    assert main(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(meg), "--tp", "2"]) == 0
    link = _link_out(meg, name, outside)
    for argv in (["convert", "megatron-to-hf", "--megatron", str(meg)], ["reshard", "--src", str(meg), "--tp", "1"]):
        cli_fails(argv + ["--out", str(tmp_path / "o")], capsys, str(link), "a symlink to", "outside")
        assert not (tmp_path / "o").exists()
