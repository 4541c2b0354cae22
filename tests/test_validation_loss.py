"""Validation and `hf-megatron evaluate` as Megatron-LM's evaluate computes them: one token-weighted
mean over every evaluated global batch (sum of per-token losses / scored tokens), judged by
transformers' masked mean; SFT data with no scored token is a one-line error in evaluation and a
warned, unlogged loss in training."""
import json

import pytest

from hf_megatron.cli import main
from hf_megatron.parallel import state
from test_sft import SEQ, _hf_labels, _hf_loss, _preprocess, _records
from tiny import VOCAB, tiny_hf_model


def _cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main([str(a) for a in args])
    finally:
        state.reset()
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _truncated(records):
    """The same records with prompts longer than a window: no response token is left to score."""
    return [{**r, "prompt": (r["prompt"] * (SEQ + 2))[:SEQ + 2]} for r in records]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    tiny_hf_model("gpt2").save_pretrained(folder)
    return folder


def test_sft_evaluate_is_token_weighted_whatever_the_global_batch(tmp_path, hf_folder, capsys):
    """Half the windows hold no scored token: global batches of 1 and of 8 give transformers' masked mean."""
    records = _records(16, seed=5)
    records[::2] = _truncated(records[::2])
    prefix = _preprocess(tmp_path, "mix", records)
    reference = _hf_loss(tiny_hf_model("gpt2").eval(), [_hf_labels(r) for r in records])
    for gbs in (1, 8):
        code, out, err = _cli(capsys, "evaluate", "--hf-model", hf_folder, "--sft", "--data-path", prefix,
                              "--split", "0,1,0", "--seq-length", SEQ, "--micro-batch-size", 1,
                              "--global-batch-size", gbs)
        assert code == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result["samples"] == 16 and result["lm_loss"] == pytest.approx(reference, rel=1e-5), gbs


@pytest.fixture
def unscored(tmp_path):
    """SFT data whose every response lies past a window of SEQ tokens."""
    return _preprocess(tmp_path, "long", _truncated(_records(8, seed=6)))


def test_evaluate_with_no_scored_token_is_one_line(unscored, hf_folder, capsys):
    prefix = unscored
    code, _, err = _cli(capsys, "evaluate", "--hf-model", hf_folder, "--sft", "--data-path", prefix, "--split", "0,1,0",
                        "--seq-length", SEQ, "--global-batch-size", 4)
    assert code == 2 and "\n" not in err.strip()
    assert err.strip() == (f"hf-megatron evaluate: error: --data-path {prefix}: no window of the 2 evaluated global "
                           f"batches has a scored token (--sft scores response tokens only: --seq-length {SEQ} "
                           "truncates the responses away; raise it)")


def test_training_with_no_scored_token_warns_and_logs_no_loss(unscored, hf_folder, capsys):
    prefix = unscored
    code, out, err = _cli(capsys, "train", "--hf-model", hf_folder, "--sft", "--data-path", prefix, "--split", "1,0,0",
                          "--seq-length", SEQ, "--micro-batch-size", 4, "--global-batch-size", 4, "--train-iters", 2,
                          "--log-interval", 1, "--no-progress-bar")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert warnings[0] == ("hf-megatron train: warning: iteration 1: no scored tokens in this global batch: the step "
                           "applies only weight decay (its lm loss is left out of the log)")
    assert warnings[1].startswith("hf-megatron train: warning: no step of this run had a scored token (2 steps)")
    assert len(warnings) == 2
    logged = [line for line in out.splitlines() if line.startswith(" iteration ")]
    assert len(logged) == 2 and all("| lm loss: n/a |" in line and "nan iterations: 0" in line for line in logged)


def test_evaluate_of_a_run_that_never_validated_scores_one_epoch(tmp_path, hf_folder, capsys):
    """A run without --eval-interval records eval_iters 10 (the default): no count to repeat a held-out split by."""
    train = _preprocess(tmp_path, "train", _records(8, seed=7))
    held_records = _records(12, seed=8)
    held = _preprocess(tmp_path, "held", held_records)
    code, _, err = _cli(capsys, "train", "--hf-model", hf_folder, "--sft", "--data-path", train, "--split", "1,0,0",
                        "--seq-length", SEQ, "--micro-batch-size", 4, "--global-batch-size", 4, "--train-iters", 1,
                        "--lr", 0, "--save", tmp_path / "ck", "--no-progress-bar")
    assert code == 0, err
    code, out, err = _cli(capsys, "evaluate", "--load", tmp_path / "ck", "--data-path", held, "--split", "0,1,0")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert (result["global_batches"], result["samples"]) == (3, 12)  # every full global batch of 4, once
    reference = _hf_loss(tiny_hf_model("gpt2").eval(), [_hf_labels(r) for r in held_records])
    assert result["lm_loss"] == pytest.approx(reference, rel=1e-5)


def _validations(out: str) -> dict[int, float]:
    return {int(line.split("iteration ")[1].split()[0]): float(line.split("lm loss value: ")[1].split()[0])
            for line in out.splitlines() if line.startswith(" validation loss at iteration ")}


def test_each_validation_scores_the_next_batches_and_a_resume_continues_them(tmp_path, hf_folder, capsys):
    """Megatron-LM's one valid iterator per run: validation k scores the k-th --eval-iters global batches;
    consumed_valid_samples is saved and restored, and `evaluate --load` scores the latest validation's
    batches (from the split's start with --split given).  lr 0: the weights never change."""
    prefix = _preprocess(tmp_path, "d", _records(40, seed=9))
    flags = ["train", "--hf-model", hf_folder, "--sft", "--data-path", prefix, "--split", "1,1,0", "--seq-length", SEQ,
             "--micro-batch-size", 2, "--global-batch-size", 2, "--train-iters", 4, "--lr", 0, "--eval-interval", 1,
             "--eval-iters", 1, "--no-progress-bar"]
    code, out, err = _cli(capsys, *flags, "--save", tmp_path / "whole")
    assert code == 0, err
    whole = _validations(out)
    assert sorted(whole) == [1, 2, 3, 4] and len(set(whole.values())) == 4
    code, out, err = _cli(capsys, *flags, "--save", tmp_path / "parts", "--exit-interval", 2)
    assert code == 0 and _validations(out) == {1: whole[1], 2: whole[2]}, err
    code, out, err = _cli(capsys, *flags, "--save", tmp_path / "parts", "--load", tmp_path / "parts")
    assert code == 0 and _validations(out) == {3: whole[3], 4: whole[4]}, err
    for extra, first, expected in (((), 6, whole[4]), (("--split", "1,1,0"), 0, whole[1])):
        code, out, err = _cli(capsys, "evaluate", "--load", tmp_path / "whole", "--data-path", prefix, *extra)
        assert code == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result["first_sample"] == first and result["lm_loss"] == pytest.approx(expected, rel=1e-6)
