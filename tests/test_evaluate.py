"""`hf-megatron evaluate` as a user runs it: on the checkpoint a training run wrote, the loss equals
that run's own `lm loss validation` at the same weights (one process; tp=2 with sequence
parallelism and pp=2 under torchrun, slow); on an HF folder it equals transformers' loss over the
same samples; bad input is one line."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hf_megatron.cli import main
from hf_megatron.parallel import state
from test_monitor import GBS, SEQ, make_corpus, train_cli
from tiny import tiny_config, tiny_hf_model

EVAL_ITERS, SPLIT = 4, "99,1,0"


def evaluate_cli(*args, nproc: int = 1):
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc-per-node={nproc}"]
    result = subprocess.run([*launcher, "-m", "hf_megatron.cli", "evaluate", *map(str, args)], capture_output=True,
                            text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run that validates every 2 iterations on a one-document split, so its validation data
    spans several epochs of that split (their shuffle depends on the number of samples asked
    for); the last validation is at the last iteration, just before the final save."""
    from hf_megatron.data.builder import build_gpt_datasets
    root = tmp_path_factory.mktemp("evaluate")
    make_corpus(root)
    tiny_config("llama").save_pretrained(root / "config")
    _, one_epoch, _ = build_gpt_datasets(str(root / "corpus_text_document"), split=SPLIT, seq_length=SEQ, cache_dir=None)
    assert len(one_epoch) < (8 // 2 + 1) * EVAL_ITERS * GBS  # what the run asks for its validations
    result = train_cli(root, "--split", SPLIT, "--eval-interval", 2, "--eval-iters", EVAL_ITERS, "--save", root / "ckpt")
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith(" validation loss at iteration 8"))
    return root, float(line.split("lm loss value: ")[1].split(" ")[0])


def test_evaluate_equals_the_training_runs_validation(trained):
    """Only --load and --data-path: split, seed, seq length, batch and eval iters come from the checkpoint."""
    root, validation = trained
    result = evaluate_cli("--load", root / "ckpt", "--data-path", root / "corpus_text_document")
    assert (result["data_split"], result["seed"], result["seq_length"]) == (SPLIT, 1234, SEQ)
    assert result["samples"] == EVAL_ITERS * GBS and result["tokens"] == EVAL_ITERS * GBS * SEQ
    assert result["lm_loss"] == pytest.approx(validation, rel=1e-6)  # the log prints 7 digits
    assert result["ppl"] == pytest.approx(math.exp(result["lm_loss"]), rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--tensor-model-parallel-size", 2, "--sequence-parallel"),
                                    ("--pipeline-model-parallel-size", 2)])
def test_evaluate_in_another_layout_under_torchrun(trained, layout):
    root, validation = trained
    result = evaluate_cli("--load", root / "ckpt", "--data-path", root / "corpus_text_document",
                          "--micro-batch-size", 1, *layout, nproc=2)
    assert result["lm_loss"] == pytest.approx(validation, rel=1e-5)


def test_evaluate_hf_folder_equals_transformers_loss(trained, tmp_path, capsys):
    """--hf-model on a whole held-out split ("--split 0,1,0"): transformers' mean loss per global batch."""
    from hf_megatron.data.builder import build_gpt_datasets
    root, _ = trained
    hf = tiny_hf_model("llama").eval()
    hf.save_pretrained(tmp_path / "hf")
    prefix = root / "corpus_text_document"
    args = ["evaluate", "--hf-model", tmp_path / "hf", "--data-path", prefix, "--split", "0,1,0", "--seq-length", SEQ,
            "--micro-batch-size", 4, "--global-batch-size", 8, "--eval-iters", 3, "--data-cache-path", tmp_path / "cache"]
    try:  # in this process: the same CLI entry point, without a second interpreter start
        assert main([str(a) for a in args]) == 0
    finally:
        state.reset()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    _, valid, _ = build_gpt_datasets(str(prefix), split="0,1,0", seq_length=SEQ, num_samples=(None, 24, None),
                                     cache_dir=str(tmp_path / "cache"))
    losses = []
    with torch.no_grad():
        for batch in range(3):
            windows = torch.from_numpy(np.stack([valid[i] for i in range(batch * 8, batch * 8 + 8)])).long()
            losses.append(hf(windows, labels=windows).loss.item())  # scores windows[:, 1:] as our targets
    assert result["lm_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def test_bad_input_is_one_line(trained, capsys):
    root, _ = trained
    assert main(["evaluate", "--load", str(root / "nope"), "--data-path", str(root / "corpus_text_document")]) == 2
    assert capsys.readouterr().err.strip() == f"hf-megatron evaluate: error: {root / 'nope'}: no such checkpoint folder"
    assert main(["evaluate", "--load", str(root / "ckpt"), "--data-path", "x", "--split", SPLIT,
                 "--eval-split", "test"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-megatron evaluate: error: EvalConfig.split (--split): expected a non-zero share for "
                          "the test split") and "\n" not in err
