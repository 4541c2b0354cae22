"""`hf-megatron train` as a user runs it: fresh init from a config.json, Megatron-layout checkpoints,
and a resumed run (--load) that ends exactly where an uninterrupted run ends."""
import json
import subprocess
import sys

import numpy as np
import pytest

from hf_megatron.data import IndexedDatasetWriter
from tiny import VOCAB, tiny_config


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "hf_megatron.cli", "train", *map(str, args)],
                          capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_cli")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(str(root / "corpus_text_document"), dtype=np.uint16) as writer:
        for _ in range(200):
            writer.add_item(rng.integers(1, VOCAB, size=int(rng.integers(20, 80))))
            writer.end_document()
    tiny_config("llama").save_pretrained(root / "config")
    return root


def _train(root, save, iters, *extra):
    return _cli("--hf-config", root / "config", "--data-path", root / "corpus_text_document", "--split", "90,10,0",
                "--seq-length", 32, "--micro-batch-size", 2, "--global-batch-size", 4, "--train-iters", iters,
                "--lr", 1e-3, "--lr-decay-iters", 6, "--lr-decay-style", "cosine", "--lr-warmup-iters", 1,
                "--log-interval", 1, "--save", save, *extra)


def test_resumed_run_ends_where_the_uninterrupted_run_ends(workspace):
    straight = _train(workspace, workspace / "straight", 6)
    assert straight.returncode == 0, straight.stderr[-2000:]
    assert "iteration      6/6" in straight.stdout
    first = _train(workspace, workspace / "resumed", 3)
    assert first.returncode == 0, first.stderr[-2000:]
    second = _train(workspace, workspace / "resumed", 6, "--load", workspace / "resumed")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "iteration      4/6" in second.stdout and "iteration      1/6" not in second.stdout
    a = json.loads((workspace / "straight" / "training_summary.json").read_text())
    b = json.loads((workspace / "resumed" / "training_summary.json").read_text())
    assert a["iterations"] == b["iterations"] == 6
    assert a["final_loss"] == pytest.approx(b["final_loss"], rel=1e-6)
    for folder in ("straight", "resumed"):
        assert (workspace / folder / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
        assert (workspace / folder / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt").is_file()


def test_missing_data_is_a_one_line_error(workspace):
    result = _cli("--hf-config", workspace / "config", "--data-path", workspace / "nope", "--train-iters", 1)
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if line]
    assert lines[-1].startswith("hf-megatron train: error:") and "nope" in lines[-1]
    assert "Traceback" not in result.stderr
