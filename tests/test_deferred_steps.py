"""--defer-step-stats (training/deferred.py): each step's host read moved after the next step's
forward and backward changes no number.  Against `train_step` step by step: the same stats (loss,
grad norm, lr, skipped, loss scale, tokens), weights, optimizer state, LR schedule and RNG state,
with dropout, two micro batches, bf16 with a step skipped on a non-finite gradient, and fp16's
skips; and `hf-megatron train --defer-step-stats` as a user runs it: the same log lines, validation
losses and checkpoint as without the flag, and a run stopped by --exit-interval or by a time limit
(with the next step already queued) resumes to the uninterrupted run's weights bit for bit."""

import pytest
import torch

from tiny import engine_batch, tiny_hf_model
from train_cli import assert_same_weights, base_args, cli_inprocess, make_workspace, weights
from training_helpers import make_batches, training_config

from hf_megatron.parallel import state
from hf_megatron.training import build_model, build_optimizer, build_scheduler, setup_parallel, split_batch, train_step
from hf_megatron.training.checkpoint import get_rng_state
from hf_megatron.training.deferred import DeferredSteps

STEPS = 6
BROKEN = 3  # the step whose gradient is made non-finite (bf16: skipped, the schedule does not advance)


def _run(deferred: bool, dtype: str, device: str = "cpu"):
    cfg = training_config({}, **{dtype: True} if dtype != "fp32" else {})
    setup_parallel(cfg)
    try:
        chunks = build_model(tiny_hf_model("llama", hidden_dropout=0.1, attention_dropout=0.1), cfg, device=device)
        optimizer, broken = build_optimizer(chunks, cfg), {"step": None}
        scheduler = build_scheduler(optimizer, cfg)
        weight = next(p for p in chunks[0].parameters() if p.ndim == 2)
        weight.register_hook(lambda g: g * float("nan") if broken["step"] == BROKEN and dtype == "bf16" else g)
        runner, stats, rng_after = DeferredSteps(chunks, optimizer, scheduler), [], []
        for i, batch in enumerate(make_batches(STEPS)):
            broken["step"] = i + 1
            micro = [{k: v.to(device) for k, v in mb.items()} for mb in split_batch(engine_batch(batch), cfg)]
            if not deferred:
                stats.append(train_step(chunks, optimizer, scheduler, micro))
                rng_after.append(get_rng_state())
            elif (previous := runner.step(micro)) is not None:
                stats.append(previous)
                rng_after.append(runner.rng_state())
        if deferred:
            stats.append(runner.finish())
            rng_after.append(runner.rng_state())
        params = [p.detach().clone() for p in optimizer.model_params]
        moments = [{k: v.clone() for k, v in s.items()} for s in optimizer.optimizer.state.values()]
        return stats, params, moments, scheduler.state_dict(), rng_after
    finally:
        state.reset()


def _same_rng(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        elif isinstance(a[key], dict):
            _same_rng(a[key], b[key])
        else:
            assert repr(a[key]) == repr(b[key]), key


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])  # CUDA: the read from pinned memory after an event
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_deferred_steps_equal_train_step(dtype, device):
    want, got = _run(False, dtype, device), _run(True, dtype, device)
    assert len(got[0]) == len(want[0]) == STEPS
    assert got[0] == want[0]  # every stat of every step, exactly
    if dtype == "bf16":
        assert [s["skipped"] for s in want[0]] == [i + 1 == BROKEN for i in range(STEPS)]
        assert want[0][BROKEN]["lr"] == want[0][BROKEN - 1]["lr"]  # the skipped step did not advance it
    if dtype == "fp16":
        assert any(s["skipped"] for s in want[0])  # the dynamic scaler's first steps overflow
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)
    for a, b in zip(got[2], want[2]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert got[3] == want[3]
    for a, b in zip(got[4], want[4]):
        _same_rng(a, b)


ITERS = 8
FLAGS = ("--hidden-dropout", 0.1, "--attention-dropout", 0.1, "--lr-decay-iters", ITERS, "--eval-interval", 2,
         "--eval-iters", 1)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("deferred"))


def _train(root, save, *extra):
    code, out, err = cli_inprocess(*base_args(root, ITERS, *FLAGS, "--save", save, *extra))
    assert code == 0, err[-2000:]
    return out


KEPT = ("iteration", "consumed samples", "learning rate", "lm loss", "loss scale", "grad norm",
        "number of skipped iterations", "number of nan iterations", "validation loss at iteration", "lm loss value")


def _logged(out: str) -> list[list[str]]:
    """The fields of the training and validation log lines that are not timings or memory."""
    lines = [line for line in out.splitlines() if "| lm loss" in line]
    return [[field.strip() for field in line.split("|") if field.strip().startswith(KEPT)] for line in lines]


def test_train_cli_with_deferred_stats_logs_saves_and_resumes_the_same(workspace):
    straight = _train(workspace, workspace / "straight")
    deferred = _train(workspace, workspace / "deferred", "--defer-step-stats")
    logged = _logged(straight)
    assert sum(row[0].startswith("iteration") for row in logged) == ITERS
    assert sum(row[0].startswith("validation") for row in logged) >= ITERS // 2
    assert _logged(deferred) == _logged(straight)
    assert_same_weights(weights(workspace / "deferred", ITERS), weights(workspace / "straight", ITERS))
    stopped = workspace / "stopped"
    out = _train(workspace, stopped, "--defer-step-stats", "--exit-interval", 3)
    assert "exiting at iteration 3: --exit-interval 3 reached" in out
    assert (stopped / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    _train(workspace, stopped, "--defer-step-stats", "--load", stopped)
    assert_same_weights(weights(stopped, ITERS), weights(workspace / "straight", ITERS))
    # an exit nobody could plan (a time limit): the next step's forward and backward (dropout) were
    # queued already; the checkpoint holds the RNG from before them, the resumed run replays them
    stopped = workspace / "timed_out"
    out = _train(workspace, stopped, "--defer-step-stats", "--exit-duration-in-mins", 1e-9)
    assert "exiting at iteration 1: --exit-duration-in-mins" in out
    _train(workspace, stopped, "--defer-step-stats", "--load", stopped)
    assert_same_weights(weights(stopped, ITERS), weights(workspace / "straight", ITERS))


def _plain_and_deferred(rank, world, jobs, batches):
    from training_helpers import our_run
    keep_alive = []
    return [(our_run(arch, layout, batches, keep_alive, **extra),
             our_run(arch, layout, batches, keep_alive, deferred=True, **extra)) for arch, layout, extra in jobs]


def test_deferred_steps_equal_train_step_over_pipeline_and_data_parallel_ranks():
    """2 processes: pp 2 (the loss on the last stage only, p2p in the queued forward and backward) and
    dp 2 with the distributed optimizer and overlapped grad reduction and param gather."""
    from dist import run_distributed
    jobs = [("llama", {"pp": 2}, {}),
            ("gpt2", {"dp": 2, "zero": True}, {"overlap_grad_reduce": True, "overlap_param_gather": True,
                                                "ddp_bucket_size": 3000})]
    results = run_distributed(_plain_and_deferred, 2, (jobs, make_batches(STEPS)))
    for rank, per_job in enumerate(results):
        for (arch, layout, _), (plain, deferred) in zip(jobs, per_job):
            label = f"{arch} {layout} rank {rank}"
            assert deferred["stats"] == plain["stats"], label
            assert plain["state"].keys() == deferred["state"].keys()
            assert all(torch.equal(deferred["state"][k], v) for k, v in plain["state"].items()), label


def test_accelerate_refuses_the_train_loop_option():
    from accelerate.utils import MegatronLMPlugin

    from hf_megatron.errors import ConfigError
    from hf_megatron.integrations.accelerate.plugin import training_config_from_plugin
    with pytest.raises(ConfigError, match="other_megatron_args: defer_step_stats is an option of `hf-megatron train`"):
        training_config_from_plugin(MegatronLMPlugin(other_megatron_args={"defer_step_stats": True}), "bf16")
