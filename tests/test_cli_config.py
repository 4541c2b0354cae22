"""One source for the training configuration, and the CLI's error contract.

`hf-megatron train`'s flags are generated from TrainingConfig / RunConfig; a bad value is refused
by the dataclass with one line naming the flag; only the project's error type (HFMegatronError)
is printed as one line, every other exception keeps its traceback."""
import argparse
import dataclasses
import subprocess
import sys

import pytest

from hf_megatron import cli
from hf_megatron.commands.flags import add_flags, configs_from_args
from hf_megatron.conversion.verify import VerifyError
from hf_megatron.data import build_gpt_datasets
from hf_megatron.errors import ConfigError, DataError, HFMegatronError
from hf_megatron.training.config import RunConfig, TrainingConfig, flag_of

# validation fails before any file is read, so the paths need not exist
BASE = ["--hf-config", "nowhere", "--data-path", "nowhere_text_document", "--train-iters", "2"]


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_flags(parser, RunConfig, TrainingConfig)
    return configs_from_args(parser.parse_args([*BASE, *argv]), RunConfig, TrainingConfig)


@pytest.mark.parametrize("argv, flag", [
    (["--log-interval", "0"], "--log-interval"),
    (["--global-batch-size", "0"], "--global-batch-size"),
    (["--clip-grad", "-1"], "--clip-grad"),
    (["--eval-iters", "-1"], "--eval-iters"),  # 0 turns validation off, as in Megatron-LM
    (["--bf16", "--fp16"], "--fp16"),
])
def test_bad_flag_value_is_one_line_through_the_real_cli(argv, flag):
    result = subprocess.run([sys.executable, "-m", "hf_megatron.cli", "train", *BASE, *argv],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hf-megatron train: error:") and flag in lines[0], lines
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("argv, fragment", [
    (["--micro-batch-size", "0"], "micro_batch_size (--micro-batch-size): expected a number >= 1, got 0"),
    (["--micro-batch-size", "2", "--global-batch-size", "3"], "expected a multiple of --micro-batch-size 2"),
    (["--train-iters", "0"], "--train-iters"),
    (["--lr-decay-style", "step"], "expected one of constant, linear, cosine, got 'step'"),
    (["--recompute-granularity", "half"], "expected one of full, selective"),
    (["--adam-beta2", "1"], "--adam-beta2"),
    (["--adam-eps", "0"], "--adam-eps"),
    (["--lr", "1e-4", "--min-lr", "1e-3"], "--min-lr"),
    (["--lr-warmup-iters", "2"], "fewer than the decay horizon 2"),
    (["--virtual-pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size > 1"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size"),
    (["--save-interval", "0"], "--save-interval"),
    (["--eval-interval", "0"], "--eval-interval"),
    (["--seq-length", "1"], "--seq-length"),
    (["--split", "a,b"], "--split 'a,b'"),
    (["--data-path", "-1", "x"], "positive blend weights"),
    (["--hf-model", "gpt2"], "exactly one of --hf-model"),
])
def test_each_validation_names_its_flag(argv, fragment):
    with pytest.raises(ConfigError if "--split" not in argv else DataError) as info:
        _parse(*argv)
    message = str(info.value)
    assert fragment in message and "\n" not in message, message
    assert isinstance(info.value, HFMegatronError) and isinstance(info.value, ValueError)


def test_flags_come_from_the_dataclasses_with_their_defaults():
    run, cfg = _parse()
    assert cfg == TrainingConfig(train_iters=2)
    assert run == RunConfig(hf_config="nowhere", data_path=["nowhere_text_document"])
    run, cfg = _parse("--bf16", "--sequence-parallel", "--data-path", "0.3", "a", "0.7", "b", "--lr-decay-iters", "5",
                      "--recompute-granularity", "selective", "--seq-length", "64")
    assert cfg.bf16 and cfg.sequence_parallel and cfg.lr_decay_iters == 5 and cfg.recompute_granularity == "selective"
    assert run.data_path == ["0.3", "a", "0.7", "b"] and run.seq_length == 64
    parser = cli.build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    flags = {option for action in train._actions for option in action.option_strings}
    for cls in (TrainingConfig, RunConfig):
        for f in dataclasses.fields(cls):
            assert flag_of(f.name) in flags, f.name
    required = {a.dest for a in train._actions if a.required}
    assert required == {"data_path"}  # --train-iters or --train-samples: `train` asks for one (test_train_cli)


def test_train_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for expected in ("--seq-length N tokens per sample (default: 1024)", "(default: 969,30,1)",
                     "--lr-decay-style {constant,linear,cosine} learning-rate decay (default: linear)",
                     "--log-interval N print every N steps (default: 10)", "(default: 1234)",
                     "--clip-grad X global gradient-norm clip; 0 disables it (default: 1.0)"):
        assert expected in text, expected


def test_from_dict_names_unknown_fields():
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['tensor_model_paralel_size'\].*did you mean "
                                          r"'tensor_model_parallel_size'"):
        TrainingConfig.from_dict({"tensor_model_paralel_size": 2})
    assert TrainingConfig.from_dict({"seed": 3, "recompute_granularity": "full"}).seed == 3
    with pytest.raises(ConfigError, match=r"micro_batch_size \(--micro-batch-size\).*got '2'"):
        TrainingConfig.from_dict({"micro_batch_size": "2"})  # e.g. a string from a YAML file


def _verb_raising(monkeypatch, exc):
    def broken(args):
        raise exc
    real = cli.build_parser

    def build_parser():
        parser = real()
        parser._subparsers._group_actions[0].choices["push"].set_defaults(func=broken)
        return parser
    monkeypatch.setattr(cli, "build_parser", build_parser)


@pytest.mark.parametrize("exc", [RuntimeError("a bug"), ValueError("a bug"), FileNotFoundError("a bug"),
                                 KeyError("a bug")])
def test_non_project_exceptions_keep_their_traceback(monkeypatch, exc):
    _verb_raising(monkeypatch, exc)
    with pytest.raises(type(exc), match="a bug"):
        cli.main(["push", "--hf", "x", "--repo-id", "o/n"])


def test_project_errors_are_one_line(monkeypatch, capsys):
    _verb_raising(monkeypatch, VerifyError("verify: logits differ"))
    assert cli.main(["push", "--hf", "x", "--repo-id", "o/n"]) == 2
    assert capsys.readouterr().err == "hf-megatron push: error: verify: logits differ\n"


def test_data_errors_are_project_errors_and_keep_their_builtin_type(tmp_path):
    with pytest.raises(DataError) as info:
        build_gpt_datasets(str(tmp_path / "nothere"), "1", 8, 1, (10, 0, 0), cache_dir=None)
    assert isinstance(info.value, FileNotFoundError) and "nothere.idx" in str(info.value)
    with pytest.raises(DataError, match="--split"):
        build_gpt_datasets(str(tmp_path / "nothere"), "", 8, 1, (10, 0, 0), cache_dir=None)


def test_sequence_parallel_needs_seq_length_divisible_by_tp(capsys):
    assert cli.main(["train", *BASE, "--seq-length", "33", "--tensor-model-parallel-size", "2",
                     "--sequence-parallel"]) == 2
    assert "--seq-length 33: expected a multiple of --tensor-model-parallel-size 2" in capsys.readouterr().err
