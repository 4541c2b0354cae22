"""Stopping and resuming with dropout > 0: a resumed run, a run stopped by SIGTERM
(--exit-signal-handler: finish the step, save, exit 0) and a run SIGKILLed at arbitrary moments
(between steps, in the middle of writing a checkpoint) all end with the weights of the
uninterrupted run, bit for bit; --no-load-rng does not (the RNG streams matter).

The killed runs are real `hf-megatron train` processes; they and the in-process runs use one
thread, so their arithmetic is the same."""
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from train_cli import assert_same_weights, base_args, cli_inprocess, env, make_workspace, weights

ITERS = 40
DROPOUT = ("--hidden-dropout", 0.1, "--attention-dropout", 0.1, "--lr-decay-iters", ITERS, "--log-interval", 1)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = make_workspace(tmp_path_factory.mktemp("signals"))
    code, _, err = cli_inprocess(*base_args(root, ITERS, *DROPOUT, "--save", root / "straight"))
    assert code == 0, err
    no_dropout = root / "no_dropout"
    assert cli_inprocess(*base_args(root, 2, "--lr-decay-iters", ITERS, "--save", no_dropout))[0] == 0
    with_dropout = root / "dropout_2"
    assert cli_inprocess(*base_args(root, 2, *DROPOUT, "--save", with_dropout))[0] == 0
    with pytest.raises(AssertionError):  # dropout is really on: it changes the trained weights
        assert_same_weights(weights(no_dropout, 2), weights(with_dropout, 2))
    return root


def _resume(root, save, iters=ITERS, *extra):
    code, out, err = cli_inprocess(*base_args(root, iters, *DROPOUT, "--save", save, "--load", save, *extra))
    assert code == 0, err[-2000:]
    return out


def _tracker(save):
    return int((save / "latest_checkpointed_iteration.txt").read_text())


def test_resume_with_dropout_is_bit_exact_and_needs_the_rng(workspace):
    save, no_rng = workspace / "resumed", workspace / "resumed_no_rng"
    for folder in (save, no_rng):
        assert cli_inprocess(*base_args(workspace, 3, *DROPOUT, "--save", folder))[0] == 0
    _resume(workspace, save)
    assert_same_weights(weights(save, ITERS), weights(workspace / "straight", ITERS))
    _resume(workspace, no_rng, ITERS, "--no-load-rng")
    with pytest.raises(AssertionError):
        assert_same_weights(weights(no_rng, ITERS), weights(workspace / "straight", ITERS))


def _staging(save):
    try:
        return any(e.name.endswith(".partial-shared") for e in os.scandir(save))
    except FileNotFoundError:
        return False


def _run_and_signal(root, save, sig, mid_save=False, timeout=120, launcher=(), save_interval=1):
    """Start a run resuming from `save`; once it has logged a step, send `sig` -- at once, or
    (mid_save) as soon as a checkpoint's staging folder appears.  (exit status, output, whether
    the signal landed during a save).  `launcher`: e.g. torchrun's arguments; the signal goes to it."""
    args = base_args(root, ITERS, *DROPOUT, "--save", save, "--load", save, "--save-interval", save_interval,
                     "--exit-signal-handler")
    command = [sys.executable, *(launcher or ["-m"]), "hf_megatron.cli", "train", *map(str, args)]
    proc = subprocess.Popen(command, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, stepped = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "| loss " in line:
                stepped.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stepped.wait(timeout)
    during_save = False
    deadline = time.monotonic() + 5
    while mid_save and proc.poll() is None and time.monotonic() < deadline and not during_save:
        during_save = _staging(save)
    if proc.poll() is None:
        proc.send_signal(sig)
    proc.wait(timeout)
    reader.join(timeout)
    return proc.returncode, "".join(lines), during_save


def _kill_and_finish(root, save, kills, seed=0, stop=signal.SIGTERM):
    """Each kill restarts from the last complete checkpoint; `stop` (SIGTERM/SIGINT) then saves and exits 0;
    the last run finishes.  The final weights must be the uninterrupted run's."""
    rng, landed_mid_save = random.Random(seed), 0
    assert cli_inprocess(*base_args(root, 2, *DROPOUT, "--save", save))[0] == 0
    for k in range(kills):
        before = _tracker(save)
        code, out, during_save = _run_and_signal(root, save, signal.SIGKILL, mid_save=k % 2 == 1 or rng.random() < 0.5)
        assert code == -signal.SIGKILL, out[-2000:]
        landed_mid_save += during_save
        assert _tracker(save) >= before  # a complete checkpoint, never a step back
        if _tracker(save) == ITERS:
            break
    before = _tracker(save)
    code, out, _ = _run_and_signal(root, save, stop)
    assert code == 0, out[-2000:]
    stopped_at = _tracker(save)
    assert f"exiting at iteration {stopped_at}: received {stop.name}" in out and before < stopped_at < ITERS, out[-2000:]
    _resume(root, save)
    assert_same_weights(weights(save, ITERS), weights(root / "straight", ITERS))
    assert not [e.name for e in os.scandir(save) if ".partial" in e.name]  # what the kills left is gone
    return landed_mid_save


def test_sigterm_and_sigkills_lose_nothing(workspace):
    _kill_and_finish(workspace, workspace / "killed", kills=2)


def test_a_resumed_run_removes_what_a_killed_save_left(workspace):
    """A SIGKILL mid-save leaves the staging folder (and maybe a tracker's temporary file); the next
    run on that --save holds its lock, so it removes them, says so, and keeps everything else."""
    save = workspace / "left_over"
    assert cli_inprocess(*base_args(workspace, 2, *DROPOUT, "--save", save))[0] == 0
    staging = save / ".iter_0000003.partial-shared"
    (staging / "mp_rank_00").mkdir(parents=True)
    (staging / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"half")
    tracker_tmp = save / ".latest_checkpointed_iteration.txt.k2x9a1"
    tracker_tmp.write_text("3")
    kept = [save / ".user-notes", save / "iter_0000009.partial-mine"]
    kept[0].write_text("mine")
    kept[1].mkdir()
    code, _, err = cli_inprocess(*base_args(workspace, 3, *DROPOUT, "--save", save, "--load", save))
    assert code == 0, err[-2000:]
    assert not staging.exists() and not tracker_tmp.exists()
    assert all(p.exists() for p in kept)
    assert ("removed what an interrupted save left there: .iter_0000003.partial-shared, "
            ".latest_checkpointed_iteration.txt.k2x9a1") in err
    assert _tracker(save) == 3


@pytest.mark.slow
def test_twelve_sigkills_many_mid_save_and_a_sigint_lose_nothing(workspace):
    landed = _kill_and_finish(workspace, workspace / "killed_many", kills=12, seed=1, stop=signal.SIGINT)
    assert landed >= 3, f"only {landed} kills landed during a save"


@pytest.mark.parametrize("flag, value, reason", [("--exit-interval", 3, "--exit-interval 3 reached"),
                                                 ("--exit-duration-in-mins", 1e-9, "--exit-duration-in-mins")])
def test_exit_interval_and_duration_save_and_exit_zero(workspace, flag, value, reason):
    save = workspace / f"exit{flag}"
    code, out, err = cli_inprocess(*base_args(workspace, ITERS, *DROPOUT, "--save", save, flag, value))
    assert code == 0, err
    stopped_at = 3 if flag == "--exit-interval" else 1
    assert f"exiting at iteration {stopped_at}: {reason}" in out and _tracker(save) == stopped_at
    _resume(workspace, save)  # and the job goes on where it stopped
    assert_same_weights(weights(save, ITERS), weights(workspace / "straight", ITERS))


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_on_every_rank_and_the_resumed_run_ends_equal(workspace):
    from dist import free_port

    def torchrun():
        return ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()), "-m"]

    def run(save, *extra):
        args = base_args(workspace, ITERS, *DROPOUT, "--save", save, *extra)
        result = subprocess.run([sys.executable, *torchrun(), "hf_megatron.cli", "train", *map(str, args)],
                                env=env(), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]

    straight, save = workspace / "dp2_straight", workspace / "dp2"
    run(straight)
    _, out, _ = _run_and_signal(workspace, save, signal.SIGTERM, launcher=torchrun(), save_interval=1000)
    stopped_at = _tracker(save)  # torchrun forwards the signal; both ranks finish the step and save
    assert f"exiting at iteration {stopped_at}: received SIGTERM" in out and 0 < stopped_at < ITERS, out[-3000:]
    run(save, "--load", save)
    assert_same_weights(weights(save, ITERS), weights(straight, ITERS))
