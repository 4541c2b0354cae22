"""sha256 sidecars of every saved tensor file, verified on load: a flipped byte in a stored
tensor is refused with one line (and, without checksums, would load silently as wrong weights)."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

import hf_megatron
from hf_megatron.checkpoint import checksums
from hf_megatron.checkpoint.files import StagingDir, save_atomic
from hf_megatron.checkpoint.load import open_megatron
from hf_megatron.cli import main
from hf_megatron.conversion.convert import hf_to_megatron, megatron_to_hf
from hf_megatron.errors import CheckpointError
from hf_megatron.parallel import state
from hf_megatron.training.checkpoint import load_checkpoint, save_checkpoint
from bad_checkpoints import flip_tensor_byte, rank_file, write_torch_dist
from test_convert_helpers import hf_sources  # noqa: F401

NAME = "embedding.word_embeddings.weight"


@pytest.fixture(autouse=True)
def default_checksums():
    checksums.set_checksums(None)
    yield
    checksums.set_checksums(None)


@pytest.fixture(scope="module")
def megatron_pp2(hf_sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("m") / "pp2"
    hf_to_megatron(hf_sources["gpt2"], out, tp=2, pp=2)
    return out


def test_every_rank_file_has_a_sidecar_that_sha256sum_accepts(megatron_pp2):
    files = sorted(megatron_pp2.rglob("model_optim_rng.pt"))
    assert len(files) == 4
    for file in files:
        assert checksums.sidecar(file).is_file()
        subprocess.run(["sha256sum", "--check", "--quiet", checksums.sidecar(file).name], cwd=file.parent, check=True)


def test_a_flipped_byte_in_a_stored_tensor_is_refused(megatron_pp2, tmp_path, capsys):
    root = tmp_path / "meg"
    shutil.copytree(megatron_pp2, root)
    bad = rank_file(root, tp_rank=0, pp_rank=0, pp=2)  # tp rank 0's vocab rows are all real (no padding)
    flip_tensor_byte(bad)
    with pytest.raises(CheckpointError, match=f"^{bad}: checksum mismatch"):
        megatron_to_hf(root, tmp_path / "hf")
    assert main(["reshard", "--src", str(root), "--out", str(tmp_path / "r")]) == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1 and "checksum mismatch" in line and "the file is corrupt" in line
    # with the check off the damage goes through unnoticed: different weights, exit 0
    assert main(["convert", "megatron-to-hf", "--megatron", str(root), "--out", str(tmp_path / "hf"),
                 "--no-checkpoint-checksums"]) == 0
    checksums.set_checksums(False)
    damaged, clean = open_megatron(root).full_state_dict(), open_megatron(megatron_pp2).full_state_dict()
    assert [n for n in clean if not torch.equal(damaged[n], clean[n])]


def test_training_checkpoints_are_checked_on_resume(tmp_path):
    from tiny import tiny_hf_model
    state.reset()
    model = hf_megatron.from_pretrained(tiny_hf_model("llama"))
    folder = save_checkpoint(tmp_path, 3, model)
    save_checkpoint(tmp_path, 3, model)  # a re-save of the iteration keeps a matching sidecar
    assert load_checkpoint(tmp_path, model) == 3
    flip_tensor_byte(folder / "mp_rank_00/model_optim_rng.pt")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(tmp_path, model)


def test_torch_dist_files_get_sidecars_at_commit_and_are_verified(megatron_pp2, tmp_path):
    reader = open_megatron(megatron_pp2)
    with StagingDir(tmp_path / "dist") as staging:
        write_torch_dist(reader.full_state_dict(), reader.args, staging.path, num_layers=2)
        staging.commit()
    distcp = sorted((tmp_path / "dist").rglob("*.distcp"))
    assert distcp and all(checksums.sidecar(f).is_file() for f in distcp)
    assert torch.equal(open_megatron(tmp_path / "dist").get(NAME), reader.get(NAME))
    raw = bytearray(distcp[0].read_bytes())
    raw[len(raw) // 2] ^= 1
    distcp[0].write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"^{distcp[0]}: checksum mismatch"):
        open_megatron(tmp_path / "dist")


def test_off_writes_no_sidecars_and_a_bad_sidecar_is_one_line(hf_sources, tmp_path):
    assert main(["convert", "hf-to-megatron", "--hf", str(hf_sources["gpt2"]), "--out", str(tmp_path / "m"),
                 "--no-checkpoint-checksums"]) == 0
    assert not list((tmp_path / "m").rglob("*.sha256"))
    checksums.set_checksums(None)
    save_atomic({"w": torch.ones(3)}, tmp_path / "x.pt")
    checksums.sidecar(tmp_path / "x.pt").write_text("garbage\n")
    from hf_megatron.checkpoint.unpickle import safe_load
    with pytest.raises(CheckpointError, match="not a sha256 line"):
        safe_load(tmp_path / "x.pt")
