"""NaN/inf steps (`--lr 1e30`: the first update blows the weights up, the second step's gradients are
not finite): --check-for-nan-in-loss-and-grad (default for fp32/bf16) stops with one line naming
the iteration, and nothing saved after the bad step is ever marked latest; with
--no-check-for-nan-in-loss-and-grad the steps are skipped and counted."""
import json

import pytest

from train_cli import base_args, cli_inprocess, last_line, make_workspace


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("nan"))


@pytest.mark.parametrize("precision", [[], ["--bf16"]])
def test_nan_stops_with_one_line_and_latest_stays_the_last_good_checkpoint(workspace, precision):
    save = workspace / f"nan{len(precision)}"
    code, out, err = cli_inprocess(*base_args(workspace, 6, "--lr", 1e30, "--save", save, "--save-interval", 1,
                                              "--exit-signal-handler", *precision))
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    line = last_line(err)
    assert line.startswith("hf-megatron train: error: iteration 2: ") and "not finite" in line, line
    assert "--check-for-nan-in-loss-and-grad" in line and "latest checkpoint: iteration 1" in line, line
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == ["iter_0000001"]
    assert not (save / "training_summary.json").exists()
    assert "iteration      2/6" not in out  # the bad step is not logged as a normal one


def test_without_the_check_bad_steps_are_skipped_and_counted(workspace):
    save = workspace / "skip"
    code, out, err = cli_inprocess(*base_args(workspace, 4, "--lr", 1e30, "--save", save,
                                              "--no-check-for-nan-in-loss-and-grad"))
    assert code == 0, err
    assert out.count("| grad norm: skipped |") == 3 and out.count("number of skipped iterations: 1 |") == 3
    summary = json.loads((save / "training_summary.json").read_text())
    assert summary["nan_iterations"] == summary["skipped_iterations"] == 3 and summary["iterations"] == 4
