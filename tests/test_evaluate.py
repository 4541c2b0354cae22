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
    assert result["first_sample"] == 3 * EVAL_ITERS * GBS  # validation 4 (at 8) scores the 4th eval_iters batches
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


def _evaluate_inprocess(capsys, *args) -> tuple[int, str, str]:
    """`hf-megatron evaluate ...` through the CLI entry point, in this process."""
    capsys.readouterr()
    try:
        code = main(["evaluate", *map(str, args)])
    finally:
        state.reset()
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_weighted_blend_is_scored_as_megatron_core_blends_the_valid_split(trained, tmp_path, capsys):
    """`--data-path 0.3 A 0.7 B` (it crashed): the valid split is megatron-core's blend of each prefix's
    valid split, sized by --eval-iters x global batch, and the loss is transformers' over its samples."""
    from data_oracle import mcore_datasets, write_random_corpus
    root, _ = trained
    first, second = str(root / "corpus_text_document"), str(tmp_path / "other")
    write_random_corpus(second, 150, seed=7, vocab=300)
    hf = tiny_hf_model("llama").eval()
    hf.save_pretrained(tmp_path / "hf")
    code, out, err = _evaluate_inprocess(
        capsys, "--hf-model", tmp_path / "hf", "--data-path", 0.3, first, 0.7, second, "--split", "90,10,0",
        "--seq-length", SEQ, "--micro-batch-size", 4, "--global-batch-size", 4, "--eval-iters", 3,
        "--data-cache-path", tmp_path / "cache")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["samples"] == 12
    _, valid, _ = mcore_datasets(([first, second], [0.3, 0.7]), "90,10,0", SEQ, 1234, [12, 12, 12])
    losses = []
    with torch.no_grad():
        for batch in range(3):
            samples = [valid[i] for i in range(batch * 4, batch * 4 + 4)]
            windows = torch.stack([torch.cat([torch.as_tensor(s["tokens"]), torch.as_tensor(s["labels"][-1:])])
                                   for s in samples]).long()
            losses.append(hf(windows, labels=windows).loss.item())
    assert result["lm_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    # without a sample count a weighted blend has no size: one line
    code, _, err = _evaluate_inprocess(capsys, "--hf-model", tmp_path / "hf", "--data-path", 0.3, first, 0.7, second,
                                       "--split", "90,10,0", "--seq-length", SEQ)
    assert code == 2 and err.startswith("hf-megatron evaluate: error: EvalConfig.eval_iters (--eval-iters): expected "
                                        "a number of global batches") and err.count("\n") == 1


def test_sft_checkpoint_is_scored_response_only_like_its_training_run(tmp_path, capsys):
    """A checkpoint trained with --sft (lr 0: the HF model's weights) is scored as training validated it,
    response tokens only: its own validation line and transformers' loss with -100 on the prompts.  An
    --hf-model takes --sft; without it, an SFT dataset is scored as text with a warning, never silently."""
    from test_sft import SEQ as SFT_SEQ, _hf_labels, _hf_loss, _preprocess, _records
    from train_cli import cli_inprocess
    records = _records(40, seed=3)
    prefix = _preprocess(tmp_path, "run", records)
    model = tiny_hf_model("gpt2")
    model.save_pretrained(tmp_path / "hf")
    code, out, err = cli_inprocess(
        "--hf-model", tmp_path / "hf", "--data-path", prefix, "--sft", "--split", "30,10,0", "--seq-length", SFT_SEQ,
        "--micro-batch-size", 10, "--global-batch-size", 30, "--train-iters", 1, "--lr", 0, "--eval-interval", 1,
        "--eval-iters", 1, "--save", tmp_path / "ck")
    assert code == 0, err[-3000:]
    validation = float(next(x for x in out.splitlines() if "validation loss at iteration 1 " in x)
                       .split("| lm loss value: ")[1].split()[0])
    reference = _hf_loss(model.eval(), [_hf_labels(r) for r in records[30:]])
    assert validation == pytest.approx(reference, rel=1e-5)

    code, out, err = _evaluate_inprocess(capsys, "--load", tmp_path / "ck", "--data-path", prefix)
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["sft"] is True and result["lm_loss"] == pytest.approx(reference, rel=1e-5)

    hf_args = ["--hf-model", tmp_path / "hf", "--data-path", prefix, "--split", "30,10,0", "--seq-length", SFT_SEQ,
               "--global-batch-size", 10, "--micro-batch-size", 10]
    code, out, err = _evaluate_inprocess(capsys, *hf_args, "--sft")
    assert code == 0 and "warning" not in err
    assert json.loads(out.strip().splitlines()[-1])["lm_loss"] == pytest.approx(reference, rel=1e-5)
    code, out, err = _evaluate_inprocess(capsys, *hf_args[:-4], "--global-batch-size", 2, "--micro-batch-size", 2)
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["sft"] is False
    assert err.startswith(f"hf-megatron evaluate: warning: --data-path {prefix} is an SFT dataset (it has a loss "
                          "mask) scored as pretraining text")


def test_sequence_and_vocabulary_beyond_the_model_are_one_line_before_building_it(trained, tmp_path, capsys,
                                                                                   monkeypatch):
    """As train: --seq-length above a learned-position model's positions, and token ids outside its
    vocabulary, are one line each (they were IndexError tracebacks), and no model is built."""
    from hf_megatron.training import trainer
    root, _ = trained
    tiny_hf_model("gpt2").save_pretrained(tmp_path / "gpt2")  # 64 positions, vocabulary 300
    tiny_hf_model("gpt2", vocab_size=100).save_pretrained(tmp_path / "small")

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the check")
    monkeypatch.setattr(trainer, "build_model", no_model)
    prefix = root / "corpus_text_document"
    code, _, err = _evaluate_inprocess(capsys, "--hf-model", tmp_path / "gpt2", "--data-path", prefix,
                                       "--seq-length", 65)
    assert code == 2 and err == ("hf-megatron evaluate: error: --seq-length 65: expected at most the model's 64 "
                                 "positions (max_position_embeddings / n_positions of its config)\n")
    code, _, err = _evaluate_inprocess(capsys, "--hf-model", tmp_path / "small", "--data-path", prefix,
                                       "--split", "90,10,0", "--seq-length", SEQ, "--data-cache-path", tmp_path / "c")
    high = int(np.frombuffer(open(f"{prefix}.bin", "rb").read(), np.uint16).max())
    assert code == 2 and err == (f"hf-megatron evaluate: error: {prefix}.bin: token id {high} outside the model's "
                                 "vocabulary [0, 100) (tokenised with another tokenizer?)\n")
    (tmp_path / "a_file").write_text("")
    code, _, err = _evaluate_inprocess(capsys, "--hf-model", tmp_path / "small", "--data-path", prefix,
                                       "--data-cache-path", tmp_path / "a_file" / "cache")
    assert code == 2 and err == (f"hf-megatron evaluate: error: --data-cache-path {tmp_path / 'a_file' / 'cache'}: "
                                 f"expected a folder, {tmp_path / 'a_file'} is a file\n")
