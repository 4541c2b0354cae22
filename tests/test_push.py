"""`hf-megatron push` against a local fake of huggingface_hub.HfApi (no network): repo creation,
branch, upload of the whole folder with a generated model card; the token is used, never printed."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import hf_megatron
import hf_megatron.conversion.hub as hub
from hf_megatron.cli import main
from hf_megatron.conversion.convert import hf_to_megatron, megatron_to_hf
from test_convert_helpers import hf_sources  # noqa: F401

SECRET = "hf_NotARealToken1234567890"


class FakeHfApi:
    calls: list = []
    fail_with: Exception | None = None

    def __init__(self, token=None):
        FakeHfApi.calls.append(("init", token))

    def create_repo(self, repo_id, private=False, exist_ok=False, repo_type=None):
        FakeHfApi.calls.append(("create_repo", repo_id, private, exist_ok))

    def create_branch(self, repo_id, branch, exist_ok=False, repo_type=None):
        FakeHfApi.calls.append(("create_branch", repo_id, branch))

    def create_commit(self, repo_id, operations, commit_message=None, revision=None, repo_type=None):
        if FakeHfApi.fail_with:
            raise FakeHfApi.fail_with
        contents = {}
        for op in operations:  # what huggingface_hub would send: a file's bytes, or bytes from memory
            source = op.path_or_fileobj
            contents[op.path_in_repo] = open(source, "rb").read() if isinstance(source, str) else bytes(source)
        FakeHfApi.calls.append(("create_commit", repo_id, revision, sorted(contents),
                                contents.get("README.md", b"").decode()))
        FakeHfApi.uploaded = contents
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/abc123")


@pytest.fixture()
def fake_hub(monkeypatch, tmp_path):
    monkeypatch.setattr(hub, "HfApi", FakeHfApi)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no token file from this machine
    monkeypatch.setenv("HF_TOKEN", SECRET)
    FakeHfApi.calls, FakeHfApi.fail_with = [], None
    return FakeHfApi


def _trained_hf_folder(hf_sources, tmp_path):
    """A Megatron checkpoint carrying training facts, converted to HF."""
    hf_to_megatron(hf_sources["llama"], tmp_path / "meg", tp=2, pp=2)
    # the training facts a trainer stores through save_checkpoint(extra=...)
    import torch
    from hf_megatron.checkpoint.checksums import sidecar
    from hf_megatron.checkpoint.unpickle import safe_load
    for rank_file in (tmp_path / "meg/release").glob("*/model_optim_rng.pt"):
        payload = safe_load(rank_file)
        payload.update(iteration=1200, consumed_train_samples=4800, loss=2.3456)  # as the training loop saves
        payload["args"].seq_length = 64
        torch.save(payload, rank_file)
        sidecar(rank_file).unlink()  # edited after the save: its checksum no longer holds
    (tmp_path / "meg/release").rename(tmp_path / "meg/iter_0001200")
    (tmp_path / "meg/latest_checkpointed_iteration.txt").write_text("1200")
    megatron_to_hf(tmp_path / "meg", tmp_path / "hf")
    return tmp_path / "hf"


def test_push_uploads_folder_with_model_card(hf_sources, tmp_path, fake_hub, capsys):
    folder = _trained_hf_folder(hf_sources, tmp_path)
    assert main(["push", "--hf", str(folder), "--repo-id", "my-org/tiny-llama", "--private", "--revision", "dev"]) == 0
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    assert "https://huggingface.co/my-org/tiny-llama/commit/abc123" in out
    calls = fake_hub.calls
    assert calls[0] == ("init", SECRET)  # the token from HF_TOKEN reaches the API
    assert calls[1] == ("create_repo", "my-org/tiny-llama", True, True)
    assert calls[2] == ("create_branch", "my-org/tiny-llama", "dev")
    _, repo, revision, files, readme = calls[3]
    assert (repo, revision) == ("my-org/tiny-llama", "dev")
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(files)
    assert readme.startswith("---\n") and "library_name: transformers" in readme
    for fact in ("LlamaForCausalLM", "| iterations | 1200 |", "| training tokens | 307,200 |", "2.346", "TP=2, PP=2",
                 hf_megatron.__version__, "| layers | 2 |"):
        assert fact in readme, fact
    assert SECRET not in readme


def test_push_errors_are_one_line_without_token(hf_sources, tmp_path, fake_hub, capsys, monkeypatch):
    folder = _trained_hf_folder(hf_sources, tmp_path)
    fake_hub.fail_with = RuntimeError(f"401 Unauthorized for token {SECRET}\nmore detail")
    assert main(["push", "--hf", str(folder), "--repo-id", "my-org/x"]) == 2
    err = capsys.readouterr().err
    assert "push to my-org/x failed" in err and SECRET not in err and len(err.strip().splitlines()) == 1

    monkeypatch.delenv("HF_TOKEN")
    assert main(["push", "--hf", str(folder), "--repo-id", "my-org/x"]) == 2
    assert "no Hugging Face token" in capsys.readouterr().err
    assert main(["push", "--hf", str(tmp_path / "meg"), "--repo-id", "my-org/x"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert json.loads((folder / "hf_megatron_training.json").read_text())["iteration"] == 1200


def _listing(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_push_leaves_the_folder_as_it_was(hf_sources, tmp_path, fake_hub, capsys):
    folder = _trained_hf_folder(hf_sources, tmp_path)
    before = _listing(folder)
    fake_hub.fail_with = RuntimeError("503 Service Unavailable")
    assert main(["push", "--hf", str(folder), "--repo-id", "my-org/x"]) == 2
    assert _listing(folder) == before  # no README.md left behind by a failed push
    fake_hub.fail_with = None
    assert main(["push", "--hf", str(folder), "--repo-id", "my-org/x"]) == 0
    assert _listing(folder) == before  # nor by a good one: the card goes from memory
    uploaded = fake_hub.uploaded
    assert {name: uploaded[name] for name in before} == before and set(uploaded) == set(before) | {"README.md"}
    # a README of the user's own is uploaded as it is
    (folder / "README.md").write_text("# my own card\n")
    assert main(["push", "--hf", str(folder), "--repo-id", "my-org/x"]) == 0
    assert fake_hub.uploaded["README.md"] == b"# my own card\n"


def test_card_of_a_plain_conversion_says_converted(hf_sources, tmp_path, fake_hub, capsys):
    hf_to_megatron(hf_sources["llama"], tmp_path / "meg")
    megatron_to_hf(tmp_path / "meg", tmp_path / "hf")
    assert main(["push", "--hf", str(tmp_path / "hf"), "--repo-id", "my-org/converted"]) == 0
    readme = fake_hub.calls[-1][-1]
    assert "converted to the `transformers` format by hf-megatron" in readme
    assert "trained with" not in readme and "| iterations |" not in readme
    assert "https://github.com/)" not in readme  # no placeholder link


def test_bad_weights_are_refused_before_anything_is_uploaded(hf_sources, tmp_path, fake_hub, capsys):
    hf_to_megatron(hf_sources["llama"], tmp_path / "meg")
    megatron_to_hf(tmp_path / "meg", tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((tmp_path / "sharded/model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    truncated = tmp_path / "sharded" / shards[1]
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    capsys.readouterr()
    assert main(["push", "--hf", str(tmp_path / "sharded"), "--repo-id", "my-org/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert str(truncated) in err and len(err.splitlines()) == 1
    truncated.unlink()  # a shard the index lists, missing
    assert main(["push", "--hf", str(tmp_path / "sharded"), "--repo-id", "my-org/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert str(truncated) in err and "missing" in err and len(err.splitlines()) == 1
    # a file linked from outside the folder would upload what the folder does not hold
    megatron_to_hf(tmp_path / "meg", tmp_path / "single")
    (tmp_path / "secret.txt").write_text("not for the Hub")
    (tmp_path / "single/notes.txt").symlink_to(tmp_path / "secret.txt")
    assert main(["push", "--hf", str(tmp_path / "single"), "--repo-id", "my-org/x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "notes.txt: a symlink to" in err and "outside" in err
    assert not [call for call in fake_hub.calls if call[0] != "init"]  # no repo created, nothing sent


def test_dry_run_checks_and_lists_without_token_or_network(hf_sources, tmp_path, fake_hub, capsys, monkeypatch):
    """--dry-run: the folder checks and the model card as push makes them, the files and sizes that
    would go, exit 0; no token read, no HfApi made; a bad folder is still one line."""
    folder = _trained_hf_folder(hf_sources, tmp_path)
    before = _listing(folder)
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(hub, "get_token", lambda: pytest.fail("dry run read the token"))
    argv = ["push", "--hf", str(folder), "--repo-id", "my-org/tiny-llama", "--revision", "dev", "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert fake_hub.calls == [] and _listing(folder) == before
    assert "would push" in out and "my-org/tiny-llama" in out and "branch dev" in out and "nothing uploaded" in out
    size = (folder / "model.safetensors").stat().st_size
    assert any(line.split()[0] == "model.safetensors" for line in out.splitlines() if line.startswith("  "))
    assert f"{size / 1e6:.1f} MB" in out or f"{size / 1e3:.1f} KB" in out
    assert "README.md" in out and "model card generated by hf-megatron" in out
    assert "library_name: transformers" in out  # the card's first lines
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:-10])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.safetensors" in err[0] and fake_hub.calls == []
    assert main(["push", "--hf", str(folder), "--repo-id", "bad", "--dry-run"]) == 2
    assert "--repo-id must look like ORG/NAME" in capsys.readouterr().err
