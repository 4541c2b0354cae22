"""`--ckpt-format torch_dist` output through the CLI (hf-to-megatron, reshard): the folder layout
megatron-core's dist_checkpointing expects, read back by our reader to the source tensors, and
one-line errors for combinations the format does not have.  megatron-core's own loader reading
it strictly is in test_megatron_interop.py."""
from __future__ import annotations

import json

import torch

from hf_megatron.checkpoint.unpickle import safe_load
from hf_megatron.cli import main
from test_convert_helpers import assert_identical, hf_sources, hf_tensors  # noqa: F401


def test_cli_writes_torch_dist_and_reshards_to_it(hf_sources, tmp_path, capsys):
    src, dist_dir, back = hf_sources["qwen2"], tmp_path / "dist", tmp_path / "back"
    assert main(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(dist_dir), "--tp", "2",
                 "--ckpt-format", "torch_dist", "--verify", "--dtype", "bf16"]) == 0
    assert "top-1 agreement 100.0%" in capsys.readouterr().out
    release = dist_dir / "release"
    assert (dist_dir / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert {".metadata", "common.pt", "metadata.json"} <= {p.name for p in release.iterdir()}
    assert json.loads((release / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    args = safe_load(release / "common.pt")["args"]
    assert (args.ckpt_format, args.tensor_model_parallel_size, args.bf16, args.padded_vocab_size) == \
        ("torch_dist", 2, True, 512)
    assert main(["convert", "megatron-to-hf", "--megatron", str(dist_dir), "--out", str(back)]) == 0
    expected = {k: v.to(torch.bfloat16) for k, v in hf_tensors(src).items()}
    assert_identical(expected, hf_tensors(back))

    # reshard: torch tp=2 x pp=2 rank files -> torch_dist, and back to rank files with legacy names
    ranks, resharded, legacy = tmp_path / "ranks", tmp_path / "resharded", tmp_path / "legacy"
    assert main(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(ranks), "--tp", "2", "--pp", "2"]) == 0
    assert main(["reshard", "--src", str(ranks), "--out", str(resharded), "--ckpt-format", "torch_dist",
                 "--verify"]) == 0
    assert main(["reshard", "--src", str(resharded), "--out", str(legacy), "--tp", "2", "--legacy-names"]) == 0
    assert "language_model" in safe_load(legacy / "release/mp_rank_01/model_optim_rng.pt")["model"]
    assert main(["convert", "megatron-to-hf", "--megatron", str(legacy), "--out", str(tmp_path / "back2")]) == 0
    assert_identical(hf_tensors(src), hf_tensors(tmp_path / "back2"))


def test_torch_dist_rejects_rank_file_options(hf_sources, tmp_path, capsys):
    for extra in (["--legacy-names"], ["--pp", "2", "--vpp", "2"]):
        assert main(["convert", "hf-to-megatron", "--hf", str(hf_sources["gpt2"]), "--out", str(tmp_path / "x"),
                     "--ckpt-format", "torch_dist", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--ckpt-format torch_dist" in err, err
    assert not (tmp_path / "x").exists()
