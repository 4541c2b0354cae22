"""The conversion CLI: verify output, thin scripts, and one-line errors for bad inputs
(truncated shard, missing rank folder, incompatible TP, wrong architecture); an interrupted or
failed conversion leaves no output that looks complete."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_megatron.checkpoint.writer as writer_module
import hf_megatron.conversion.convert as convert_module
from hf_megatron.checkpoint.files import StagingDir
from hf_megatron.cli import main
from test_convert_helpers import assert_identical, cli_fails as _fails, hf_sources, hf_tensors  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


def test_cli_converts_both_ways_with_verify(hf_sources, tmp_path, capsys):
    src, meg, back = hf_sources["qwen2"], tmp_path / "meg", tmp_path / "back"
    assert main(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(meg), "--tp", "2", "--pp", "2",
                 "--verify"]) == 0
    out = capsys.readouterr().out
    assert "max abs logit diff" in out and "top-1 agreement 100.0%" in out
    assert main(["convert", "megatron-to-hf", "--megatron", str(meg), "--out", str(back), "--verify"]) == 0
    assert "top-1 agreement 100.0%" in capsys.readouterr().out
    assert_identical(hf_tensors(src), hf_tensors(back))
    # the thin script in conversion/ runs the same verb
    result = subprocess.run([sys.executable, str(REPO / "conversion/reshard.py"), "--src", str(meg), "--out",
                             str(tmp_path / "tp1"), "--tp", "1", "--pp", "1"], capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "tp1/release/mp_rank_00/model_optim_rng.pt").is_file()


def test_bad_megatron_inputs_give_one_line_errors(hf_sources, tmp_path, capsys):
    meg = tmp_path / "meg"
    assert main(["convert", "hf-to-megatron", "--hf", str(hf_sources["llama"]), "--out", str(meg), "--tp", "2",
                 "--pp", "2"]) == 0
    _fails(["reshard", "--src", str(meg), "--out", str(tmp_path / "tp3"), "--tp", "3"], capsys,
           "not divisible by tp=3")
    assert not (tmp_path / "tp3").exists()

    truncated = tmp_path / "truncated"
    shutil.copytree(meg, truncated)
    rank_file = truncated / "release/mp_rank_01_001/model_optim_rng.pt"
    rank_file.write_bytes(rank_file.read_bytes()[: rank_file.stat().st_size // 2])
    _fails(["convert", "megatron-to-hf", "--megatron", str(truncated), "--out", str(tmp_path / "o1")], capsys,
           str(rank_file), "truncated")

    shutil.rmtree(truncated / "release/mp_rank_01_001")
    _fails(["convert", "megatron-to-hf", "--megatron", str(truncated), "--out", str(tmp_path / "o2")], capsys,
           "mp_rank_01_001", "missing")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()

    _fails(["convert", "megatron-to-hf", "--megatron", str(tmp_path), "--out", str(tmp_path / "o3")], capsys,
           "not a Megatron checkpoint")
    _fails(["convert", "hf-to-megatron", "--hf", str(hf_sources["llama"]), "--out", str(meg)], capsys,
           "exists and is not empty")


def test_bad_hf_inputs_give_one_line_errors(hf_sources, tmp_path, capsys):
    bert = tmp_path / "bert"
    shutil.copytree(hf_sources["gpt2"], bert)
    config = json.loads((bert / "config.json").read_text())
    (bert / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    _fails(["convert", "hf-to-megatron", "--hf", str(bert), "--out", str(tmp_path / "o")], capsys,
           "unsupported model_type 'bert'")

    truncated = tmp_path / "truncated_hf"
    shutil.copytree(hf_sources["gpt2"], truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    _fails(["convert", "hf-to-megatron", "--hf", str(truncated), "--out", str(tmp_path / "o")], capsys,
           str(weights))
    assert not (tmp_path / "o").exists()


def test_failed_verify_and_interrupted_runs_leave_no_output(hf_sources, tmp_path, capsys, monkeypatch):
    real_mapping = convert_module.hf_to_mcore

    def wrong_mapping(get, config, layers=None):  # a conversion bug: one matrix scaled
        for name, tensor in real_mapping(get, config, layers):
            yield name, tensor * 1.5 if name.endswith("1.mlp.linear_fc2.weight") else tensor

    monkeypatch.setattr(convert_module, "hf_to_mcore", wrong_mapping)
    _fails(["convert", "hf-to-megatron", "--hf", str(hf_sources["mistral"]), "--out", str(tmp_path / "bad"),
            "--verify"], capsys, "tensor model.layers.1.mlp.down_proj.weight differs from the source")
    monkeypatch.setattr(convert_module, "hf_to_mcore", real_mapping)

    saves = []
    real_save = writer_module.torch.save

    def save_then_crash(obj, path):
        saves.append(path)
        if len(saves) == 2:
            raise KeyboardInterrupt  # Ctrl-C half way through the rank files
        real_save(obj, path)

    monkeypatch.setattr(writer_module.torch, "save", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        main(["convert", "hf-to-megatron", "--hf", str(hf_sources["mistral"]), "--out", str(tmp_path / "cut"),
              "--tp", "2"])
    monkeypatch.setattr(writer_module.torch, "save", real_save)
    # a hard kill skips the clean-up: what is left is a hidden .partial folder, never `cut`
    monkeypatch.setattr(StagingDir, "abort", lambda self: None)
    monkeypatch.setattr(writer_module.torch, "save", save_then_crash)
    saves.clear()
    with pytest.raises(KeyboardInterrupt):
        main(["convert", "hf-to-megatron", "--hf", str(hf_sources["mistral"]), "--out", str(tmp_path / "cut"),
              "--tp", "2"])
    left = sorted(p.name for p in tmp_path.iterdir())
    assert "bad" not in left and "cut" not in left
    assert [n for n in left if n.startswith(".cut.partial-")] and not any(
        (tmp_path / n / "latest_checkpointed_iteration.txt").exists() for n in left if n.startswith("."))


def test_megatron_lm_convert_tool_spellings_write_the_same_checkpoints(hf_sources, tmp_path, capsys):
    """--load-dir / --save-dir / --target-*-parallel-size (Megatron-LM's tools/checkpoint/convert.py)
    write what our spellings write."""
    src = hf_sources["qwen2"]
    assert main(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "ours"), "--tp", "2"]) == 0
    assert main(["convert", "hf-to-megatron", "--load-dir", str(src), "--save-dir", str(tmp_path / "theirs"),
                 "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "1"]) == 0
    from hf_megatron.checkpoint.unpickle import safe_load

    def rank_tensors(name, rank):
        model = safe_load(tmp_path / name / "release" / rank / "model_optim_rng.pt")["model"]
        return {key: value for key, value in model.items() if isinstance(value, torch.Tensor)}

    for rank in ("mp_rank_00", "mp_rank_01"):
        ours = rank_tensors("ours", rank)
        assert ours
        assert_identical(ours, rank_tensors("theirs", rank))
    assert main(["reshard", "--load-dir", str(tmp_path / "theirs"), "--save-dir", str(tmp_path / "pp2"),
                 "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "2"]) == 0
    assert (tmp_path / "pp2/release/mp_rank_00_001/model_optim_rng.pt").is_file()
    assert main(["convert", "megatron-to-hf", "--load-dir", str(tmp_path / "pp2"), "--save-dir",
                 str(tmp_path / "back")]) == 0
    capsys.readouterr()
    assert_identical(hf_tensors(src), hf_tensors(tmp_path / "back"))


@pytest.mark.parametrize("direction", ["hf-to-megatron", "megatron-to-hf"])
def test_verify_sees_a_wrong_row_the_prompt_never_reads(hf_sources, tmp_path, capsys, monkeypatch, direction):
    """One embedding row the 16-token verify prompt never looks up, off by 5: the logits agree, the
    tensors read back do not, and nothing is written."""
    import hf_megatron.conversion.hf_writer as writer
    src, meg = hf_sources["llama"], tmp_path / "meg"
    if direction == "megatron-to-hf":
        assert main(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(meg), "--tp", "2"]) == 0
    module, name = (convert_module, "hf_to_mcore") if direction == "hf-to-megatron" else (writer, "mcore_to_hf")
    real = getattr(module, name)

    def off_by_one_row(get, config, layers=None):
        for key, tensor in real(get, config, layers):
            if key in ("embedding.word_embeddings.weight", "model.embed_tokens.weight"):
                tensor = tensor.clone()
                tensor[200] += 5.0
            yield key, tensor

    monkeypatch.setattr(module, name, off_by_one_row)
    source = ["--hf", str(src)] if direction == "hf-to-megatron" else ["--megatron", str(meg)]
    _fails(["convert", direction, *source, "--out", str(tmp_path / "out"), "--verify"], capsys,
           "embed", "differs from the source (max abs diff 5 at (200, 0))")
    assert not (tmp_path / "out").exists()
