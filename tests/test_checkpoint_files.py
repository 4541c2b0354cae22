"""Checkpoint folders on disk: re-saving an iteration replaces it atomically (the tracker never
names a missing or half-written folder, whatever step is interrupted), a re-save keeps recorded
facts it passes as None, and side files (tokenizer) are never copied through symlinks that
leave their folder."""
from __future__ import annotations

import os

import pytest
import torch

import hf_megatron
import hf_megatron.checkpoint.files as files
from hf_megatron.checkpoint.unpickle import safe_load
from hf_megatron.conversion.hf_writer import copy_tokenizer
from hf_megatron.errors import CheckpointError
from hf_megatron.parallel import state
from hf_megatron.training.checkpoint import checkpoint_info, load_checkpoint, save_checkpoint
from tiny import tiny_hf_model

RANK_FILE = "iter_0000003/mp_rank_00/model_optim_rng.pt"


@pytest.fixture
def model():
    state.reset()
    return hf_megatron.from_pretrained(tiny_hf_model("gpt2"))


def _bump(model, value: float) -> None:
    with torch.no_grad():
        model.decoder.final_layernorm.weight.fill_(value)


def _saved_norm(root) -> float:
    return safe_load(root / RANK_FILE)["model"]["decoder.final_layernorm.weight"][0].item()


def _hidden(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("can_exchange", [True, False])
def test_resave_replaces_the_iteration_whole(model, tmp_path, monkeypatch, can_exchange):
    if not can_exchange:  # the path for systems without renameat2(RENAME_EXCHANGE)
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    _bump(model, 1.0)
    save_checkpoint(tmp_path, 3, model, extra={"note": "first"})
    (tmp_path / "iter_0000003" / "stale_file").write_text("from the first save")
    _bump(model, 2.0)
    save_checkpoint(tmp_path, 3, model, extra={"note": "second"})
    assert _saved_norm(tmp_path) == 2.0 and checkpoint_info(tmp_path)["note"] == "second"
    assert not (tmp_path / "iter_0000003" / "stale_file").exists()  # replaced, not merged
    assert _hidden(tmp_path) == [] and (tmp_path / files.TRACKER).read_text() == "3"


def test_interrupted_resave_leaves_a_complete_iteration(model, tmp_path, monkeypatch):
    _bump(model, 1.0)
    save_checkpoint(tmp_path, 3, model)

    class Broken:
        def state_dict(self):
            raise RuntimeError("disk full")

    _bump(model, 2.0)
    with pytest.raises(RuntimeError, match="disk full"):  # while writing the rank files
        save_checkpoint(tmp_path, 3, model, scheduler=Broken())
    assert _saved_norm(tmp_path) == 1.0 and load_checkpoint(tmp_path, model) == 3

    # killed right after the swap, before the old folder is removed: the new one is in place
    real_exchange, seen = files._exchange, []

    def swap_then_die(new, final):
        assert real_exchange(new, final)
        seen.append(final.is_dir() and (final / "mp_rank_00/model_optim_rng.pt").is_file())
        raise KeyboardInterrupt

    monkeypatch.setattr(files, "_exchange", swap_then_die)
    _bump(model, 3.0)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 3, model)
    monkeypatch.undo()
    assert seen == [True] and _saved_norm(tmp_path) == 3.0
    assert files.resolve_iteration_dir(tmp_path)[0] == tmp_path / "iter_0000003"
    save_checkpoint(tmp_path, 3, model)  # the next save clears what the killed one left
    assert _hidden(tmp_path) == []


def test_resave_keeps_recorded_facts_given_as_none(model, tmp_path):
    save_checkpoint(tmp_path, 3, model, args={"seq_length": 64},
                    extra={"loss": 2.5, "final_loss": 2.5, "consumed_train_samples": 12})
    # e.g. a run resumed at its last iteration saves again without a new loss
    save_checkpoint(tmp_path, 3, model, args={"seq_length": None},
                    extra={"loss": None, "final_loss": None, "consumed_train_samples": 12})
    info = checkpoint_info(tmp_path)
    assert (info["loss"], info["final_loss"], info["args"]["seq_length"]) == (2.5, 2.5, 64)
    # a first save stores what it is given
    save_checkpoint(tmp_path, 4, model, extra={"loss": None})
    assert "loss" in checkpoint_info(tmp_path) and checkpoint_info(tmp_path)["loss"] is None


def test_tokenizer_symlinks_may_not_leave_the_folder(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not a tokenizer")
    source = tmp_path / "tok"
    source.mkdir()
    (source / "vocab.json").write_text("{}")
    (source / "merges.txt").symlink_to(source / "vocab.json")  # inside: fine
    out = tmp_path / "out"
    out.mkdir()
    assert sorted(copy_tokenizer(source, out)) == ["merges.txt", "vocab.json"]

    (source / "tokenizer.json").symlink_to(secret)
    out2 = tmp_path / "out2"
    out2.mkdir()
    with pytest.raises(CheckpointError, match=r"tokenizer.json: a symlink to .*secret.txt, outside .*tok; refusing"):
        copy_tokenizer(source, out2)
    assert not (out2 / "tokenizer.json").exists()
    (source / "tokenizer.json").unlink()
    (source / "tokenizer.json").symlink_to(os.path.relpath(secret, source))  # relative: the same
    with pytest.raises(CheckpointError, match="refusing to copy"):
        copy_tokenizer(source, out2)


def test_hub_cache_snapshot_links_into_its_blobs(tmp_path):
    """A Hub cache snapshot's files link to ../../blobs: inside the repo's cache folder, allowed;
    a link out of the repo's cache folder is not."""
    repo = tmp_path / "hub/models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs/abc123").write_text("{}")
    snapshot = repo / "snapshots/0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").symlink_to("../../blobs/abc123")
    out = tmp_path / "out"
    out.mkdir()
    assert copy_tokenizer(snapshot, out) == ["tokenizer.json"] and (out / "tokenizer.json").read_text() == "{}"
    (tmp_path / "hub/elsewhere").write_text("x")
    (snapshot / "vocab.json").symlink_to("../../../elsewhere")
    with pytest.raises(CheckpointError, match="vocab.json: a symlink"):
        copy_tokenizer(snapshot, out)
