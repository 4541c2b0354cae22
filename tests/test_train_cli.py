"""`hf-megatron train` as a user runs it: fresh init from a config.json, Megatron-layout checkpoints,
a resumed run (--load) that ends exactly where an uninterrupted run ends, fp16 with default flags,
the --load rules, --train-samples, the checks done before the model is built and the --save lock."""
import json
import os
import shutil
import time

import pytest
import torch

from train_cli import (base_args, cli_inprocess, cli_subprocess, error_line, learning_rates,
                       make_workspace)

from hf_megatron.training.lock import LOCK_FILE, SaveLock


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("train_cli"))


def _train(root, save, iters, *extra, run=cli_inprocess):
    return run(*base_args(root, iters, "--lr-decay-iters", 6, "--lr-decay-style", "cosine", "--lr-warmup-iters", 1,
                          "--save", save, *extra))


def _summary(folder):
    return json.loads((folder / "training_summary.json").read_text())


def _tracker(folder):
    return (folder / "latest_checkpointed_iteration.txt").read_text().strip()


def test_resumed_run_ends_where_the_uninterrupted_run_ends(workspace):
    code, out, err = _train(workspace, workspace / "straight", 6, run=cli_subprocess)  # once as a user types it
    assert code == 0, err[-2000:]
    assert "iteration      6/6" in out
    code, _, err = _train(workspace, workspace / "resumed", 3)
    assert code == 0, err[-2000:]
    code, out, err = _train(workspace, workspace / "resumed", 6, "--load", workspace / "resumed")
    assert code == 0, err[-2000:]
    assert "iteration      4/6" in out and "iteration      1/6" not in out
    a, b = _summary(workspace / "straight"), _summary(workspace / "resumed")
    assert a["iterations"] == b["iterations"] == 6
    assert a["final_loss"] == pytest.approx(b["final_loss"], rel=1e-6)
    assert b["consumed_samples"] == 24 and b["skipped_iterations"] == 0 and b["nan_iterations"] == 0
    for folder in ("straight", "resumed"):
        assert _tracker(workspace / folder) == "6"
        assert (workspace / folder / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt").is_file()


def test_a_load_that_already_reached_train_iters_says_so_and_writes_nothing(workspace):
    folder = workspace / "done"
    assert _train(workspace, folder, 3)[0] == 0
    before = {p.name: p.stat().st_mtime_ns for p in folder.rglob("*")}
    code, out, err = _train(workspace, folder, 2, "--load", folder)
    assert code == 0, err
    assert "already reaches --train-iters 2" in out and "iteration 3" in out
    assert {p.name: p.stat().st_mtime_ns for p in folder.rglob("*") if p.name != LOCK_FILE} == \
        {k: v for k, v in before.items() if k != LOCK_FILE}
    assert _tracker(folder) == "3" and not (folder / "iter_0000002").exists()


def test_fp16_with_default_flags_logs_skipped_steps_and_finishes(workspace):
    # loss scale 2^32 overflows fp16 gradients: Megatron-LM skips those steps and lowers the scale
    code, out, err = _train(workspace, workspace / "fp16", 4, "--fp16", "--log-interval", 2)
    assert code == 0, err[-2000:]
    # counted per log interval, as Megatron-LM's training_log (was cumulative: 2, then 4)
    assert out.count("| grad norm: skipped |") == 2 and out.count("| number of skipped iterations: 2 |") == 2
    assert _summary(workspace / "fp16")["skipped_iterations"] == 4
    code, out, err = _train(workspace, workspace / "fp16_scaled", 4, "--fp16", "--initial-loss-scale", 64)
    assert code == 0, err[-2000:]
    assert "grad norm: skipped" not in out and _summary(workspace / "fp16_scaled")["skipped_iterations"] == 0
    code, out, err = _train(workspace, workspace / "fp16_static", 2, "--fp16", "--loss-scale", 2.0 ** 40)
    assert code == 0 and _summary(workspace / "fp16_static")["skipped_iterations"] == 2  # static: never lowered


def test_loss_scale_applies_in_bf16_and_is_warned_where_megatron_core_has_no_scaler(workspace):
    """megatron-core gives bf16 (and the distributed optimizer) a constant grad scaler when --loss-scale is given."""
    def losses(out):
        return [x.split("| lm loss: ")[1].split(" ")[0] for x in out.splitlines() if x.startswith(" iteration")]

    code, plain, err = _train(workspace, workspace / "bf16_plain", 3, "--bf16")
    assert code == 0, err[-2000:]
    # a power of two scales and unscales bf16 / fp32 gradients exactly: the same run
    code, scaled, err = _train(workspace, workspace / "bf16_scaled", 3, "--bf16", "--loss-scale", 1024)
    assert code == 0 and "warning" not in err, err[-2000:]
    assert "bf16 (fp32 main weights, static loss scale 1024)" in scaled.splitlines()[0]
    assert losses(scaled) == losses(plain) and len(losses(plain)) == 3
    # a scale that overflows the scaled loss: every step is skipped, as megatron-core's found_inf does
    code, out, err = _train(workspace, workspace / "bf16_huge", 2, "--bf16", "--loss-scale", 1e38)
    assert code == 0, err[-2000:]
    assert out.count("| grad norm: skipped |") == 2 and _summary(workspace / "bf16_huge")["skipped_iterations"] == 2
    code, out, err = _train(workspace, workspace / "fp32_scale", 1, "--loss-scale", 1024)
    assert code == 0 and err.splitlines()[0] == (
        "hf-megatron train: warning: --loss-scale 1024: not applied in fp32 without --use-distributed-optimizer "
        "(megatron-core's FP32Optimizer has no loss scaler)")


@pytest.mark.parametrize("where, expected", [
    ("missing", "no such folder; a --load without a checkpoint is accepted only when it is this run's --save"),
    ("iter", "an iteration folder; give the checkpoint folder that holds latest_checkpointed_iteration.txt"),
    ("empty", "not a Megatron checkpoint folder (no latest_checkpointed_iteration.txt)"),
])
def test_load_without_a_checkpoint_is_an_error_unless_it_is_the_new_runs_save_folder(workspace, where, expected):
    load = {"missing": workspace / "typo", "iter": workspace / "done" / "iter_0000003", "empty": workspace / "config"}
    if where == "iter" and not load["iter"].exists():
        _train(workspace, workspace / "done", 3)
    line = error_line(_train(workspace, workspace / f"new_{where}", 1, "--load", load[where]))
    assert expected in line and str(load[where]) in line, line
    assert not (workspace / f"new_{where}" / "latest_checkpointed_iteration.txt").exists()


def test_load_of_the_save_folder_starts_a_new_run_unless_exit_on_missing_checkpoint(workspace):
    folder = workspace / "fresh_here"
    line = error_line(_train(workspace, folder, 1, "--load", folder, "--exit-on-missing-checkpoint"))
    assert "--exit-on-missing-checkpoint" in line
    code, out, _ = _train(workspace, folder, 1, "--load", folder)
    assert code == 0 and "iteration      1/1" in out and _tracker(folder) == "1"


def test_train_samples_and_warmup_fraction_follow_megatron(workspace):
    # 14 samples // 4 per step = 3 steps; warmup 0.5 of the 4-step horizon = 2 steps: the steps use lr 0, lr/2,
    # lr; each log line shows the lr after its step (Megatron-LM's): lr/2, lr, then halfway down the linear decay
    code, out, err = cli_inprocess(*base_args(workspace, None, "--train-samples", 14, "--lr-warmup-fraction", 0.5,
                                             "--lr-decay-iters", 4, "--save", workspace / "samples"))
    assert code == 0, err
    assert learning_rates(out) == ["5.000e-04", "1.000e-03", "5.000e-04"]
    line = error_line(cli_inprocess(*base_args(workspace, 2, "--train-samples", 8)))
    assert "--train-iters (2) and --train-samples (8) are exclusive" in line
    assert "expected --train-iters N or --train-samples N" in error_line(cli_inprocess(*base_args(workspace, None)))


def test_train_samples_schedule_spans_the_samples_as_megatron_lms(workspace):
    """Megatron-LM's --train-samples schedule is counted in samples: the decay horizon (and its warmup
    fraction) and wd_incr_steps are train_samples itself, not the whole global batches (14 samples at 4
    per step: 3 steps over a 14-sample horizon; it was 12).  Reference: megatron-core's
    OptimizerParamScheduler set up as Megatron-LM's get_optimizer_param_scheduler sets it up."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from hf_megatron.checkpoint.unpickle import safe_load
    samples, gbs = 14, 4
    code, out, err = cli_inprocess(*base_args(workspace, None, "--train-samples", samples, "--lr-warmup-fraction",
                                              0.25, "--lr-decay-style", "cosine", "--min-lr", 1e-4,
                                              "--save", workspace / "samples_horizon"))
    assert code == 0, err
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4,
                                        lr_warmup_steps=0.25 * samples, lr_decay_steps=samples,
                                        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=samples,
                                        wd_incr_style="constant")
    expected = []
    for _ in range(samples // gbs):
        scheduler.step(increment=gbs)
        expected.append(optimizer.param_groups[0]["lr"])
    assert learning_rates(out) == [f"{lr:.3e}" for lr in expected]
    saved = safe_load(workspace / "samples_horizon" / "iter_0000003" / "mp_rank_00" /
                      "model_optim_rng.pt")["opt_param_scheduler"]
    reference = scheduler.state_dict()
    for key in ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps", "num_steps"):
        assert saved[key] == reference[key] and type(saved[key]) is type(reference[key]), key
    # a changed global batch leaves a schedule in samples as it is: Megatron-LM resumes it without
    # --override-opt_param-scheduler, at iteration 3 of 14 // 2 = 7 (an iteration-based one needs the flag)
    code, out, err = cli_inprocess(*base_args(workspace, None, "--train-samples", samples, "--lr-warmup-fraction",
                                              0.25, "--lr-decay-style", "cosine", "--min-lr", 1e-4,
                                              "--global-batch-size", 2, "--load", workspace / "samples_horizon",
                                              "--save", workspace / "samples_horizon"))
    assert code == 0, err
    expected = []
    for _ in range(samples // 2 - 3):
        scheduler.step(increment=2)
        expected.append(optimizer.param_groups[0]["lr"])
    assert "iteration      4/7" in out and learning_rates(out) == [f"{lr:.3e}" for lr in expected]


def test_changed_global_batch_size_is_refused_or_continues_by_consumed_samples(workspace):
    folder = workspace / "gbs"
    assert _train(workspace, folder, 2)[0] == 0
    line = error_line(_train(workspace, folder, 4, "--load", folder, "--global-batch-size", 8))
    assert "the LR schedule differs from the checkpoint's" in line and "--override-opt_param-scheduler" in line
    code, out, err = _train(workspace, folder, 4, "--load", folder, "--global-batch-size", 8,
                            "--override-opt_param-scheduler")
    assert code == 0, err
    assert "iteration      3/4" in out and _summary(folder)["consumed_samples"] == 2 * 4 + 2 * 8


def test_a_resume_whose_samples_are_no_whole_number_of_new_batches_goes_on_as_megatron_lm(workspace):
    """4 samples seen, batches of 8 now: Megatron-LM's scheduler counts samples (num_steps 4, then 12,
    20, ...) and its sampler starts at sample 4; this was refused ('not a multiple of the global batch
    size'). The learning rates are megatron-core's OptimizerParamScheduler's at those sample counts."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    folder = workspace / "gbs_fraction"
    assert _train(workspace, folder, 1)[0] == 0
    code, out, err = _train(workspace, folder, 3, "--load", folder, "--global-batch-size", 8,
                            "--override-opt_param-scheduler")
    assert code == 0, err
    assert "iteration      3/3" in out and _summary(folder)["consumed_samples"] == 4 + 2 * 8
    # the flags' schedule in samples of the new batch (warmup 1 iteration, cosine decay over 6, lr 1e-3)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    reference = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=0.0, lr_warmup_steps=1 * 8,
                                        lr_decay_steps=6 * 8, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=3 * 8, wd_incr_style="constant")
    reference.num_steps = 4  # the checkpoint's count; Megatron-LM logs the rate after each step's increment
    expected = []
    for _ in range(2):
        reference.step(increment=8)
        expected.append(optimizer.param_groups[0]["lr"])
    assert learning_rates(out) == [f"{lr:.3e}" for lr in expected], (learning_rates(out), expected)
    saved = torch.load(folder / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert saved["opt_param_scheduler"]["num_steps"] == 4 + 2 * 8


def test_bad_inputs_fail_before_the_model_is_built(workspace, tmp_path):
    from tiny import tiny_config
    tiny_config("gpt2").save_pretrained(tmp_path / "gpt2")  # learned positions
    n_positions = json.loads((tmp_path / "gpt2" / "config.json").read_text())["n_positions"]
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    cases = [
        (["--hf-config", tmp_path / "gpt2", "--seq-length", n_positions + 1],
         f"--seq-length {n_positions + 1}: expected at most the model's {n_positions} positions"),
        (["--split", "0,1,0"], "--split '0,1,0': the training split gets no share"),
        (["--split", "999,1,0", "--eval-interval", 1],
         "the valid split of"),
        (["--data-path", workspace / "nope"], "nope"),
        (["--global-batch-size", 5], "global_batch_size (--global-batch-size): expected a multiple of"),
        # were tracebacks: FileExistsError once the model was built, NotADirectoryError building the data
        (["--tensorboard-dir", a_file], f"error: --tensorboard-dir {a_file}: expected a folder, {a_file} is a file"),
        (["--data-cache-path", a_file / "cache"],
         f"error: --data-cache-path {a_file / 'cache'}: expected a folder, {a_file} is a file"),
        (["--save", a_file / "ckpt"], f"error: --save {a_file / 'ckpt'}: expected a folder, {a_file} is a file"),
        # was "num_layers=2 is not divisible by 4 pipeline chunks; pass an explicit per-stage layer list" (no flag)
        (["--pipeline-model-parallel-size", 2, "--virtual-pipeline-model-parallel-size", 2],
         "error: --pipeline-model-parallel-size 2 x --virtual-pipeline-model-parallel-size 2 = 4 model chunks: "
         "expected a divisor of the model's 2 layers"),
        # megatron-core's DynamicGradScaler asserts min_scale <= initial_scale (it was accepted)
        (["--fp16", "--initial-loss-scale", 1, "--min-loss-scale", 10],
         "error: TrainingConfig.min_loss_scale (--min-loss-scale): expected at most --initial-loss-scale 1, got 10"),
    ]
    for extra, expected in cases:
        started = time.perf_counter()
        line = error_line(cli_inprocess(*base_args(workspace, 1), *extra))
        assert expected in line, line
        assert time.perf_counter() - started < 2.0, (extra, "took too long: checked after building the model?")
    # the test split is never read by `train`: Megatron's default split on a small corpus trains
    code, _, err = cli_inprocess(*base_args(workspace, 1, split="969,30,1"))
    assert code == 0, err


def test_a_second_writer_of_a_save_folder_gets_a_clearerror_line(workspace):
    folder = workspace / "locked"
    lock = SaveLock(folder).acquire()  # another run holding the folder
    try:
        line = error_line(_train(workspace, folder, 1))
        assert f"--save {folder}: in use by another training run (pid {os.getpid()}" in line
    finally:
        lock.release()
    (folder / LOCK_FILE).write_text("pid 999999999 on a-dead-host")  # left by a killed run: no flock held
    code, _, err = _train(workspace, folder, 1)
    assert code == 0, err


def test_a_load_of_another_model_shape_names_the_tensor_and_leaves_no_save_folder(workspace, tmp_path):
    """An --hf-config of another shape is refused by its args (check_checkpoint_args); a checkpoint whose
    tensors differ from its own args names the tensor (the message named none: torch's first line); the
    failed runs and a run with nothing to train left <save>/ holding only .hf_megatron.lock."""
    from tiny import tiny_config
    config = tiny_config("llama")
    tiny_config("llama", intermediate_size=96).save_pretrained(tmp_path / "narrow")
    source = tmp_path / "source"
    assert _train(workspace, source, 2)[0] == 0
    save = tmp_path / "new" / "run"
    line = error_line(cli_inprocess(*base_args(workspace, 4, "--hf-config", tmp_path / "narrow", "--load", source,
                                           "--save", save, config=False)))
    assert f"checkpoint's ffn_hidden_size is {config.intermediate_size}, --hf-config {tmp_path / 'narrow'} makes it 96" \
        in line, line
    assert not (tmp_path / "new").exists()
    # a damaged rank file (its args kept): fc1 cut to 96 rows of gate and of up; checksums off, or they'd say it
    damaged = tmp_path / "damaged"
    shutil.copytree(source, damaged)
    rank_file = damaged / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(rank_file, weights_only=False)
    for name in [k for k in state["model"] if k.endswith("mlp.linear_fc1.weight")]:
        state["model"][name] = state["model"][name][: 2 * 96].clone()
    for name in [k for k in state["model"] if k.endswith("mlp.linear_fc2.weight")]:
        state["model"][name] = state["model"][name][:, :96].clone()
    torch.save(state, rank_file)
    line = error_line(cli_inprocess(*base_args(workspace, 4, "--load", damaged, "--save", save, "--no-load-optim",
                                               "--no-checkpoint-checksums")))
    # SwiGLU fc1 holds gate and up: 2 x intermediate rows of hidden columns
    assert (f"{rank_file}: tensor 'decoder.layers.0.mlp.linear_fc1.weight' has shape ({2 * 96}, {config.hidden_size}), "
            f"expected ({2 * config.intermediate_size}, {config.hidden_size}) from the checkpoint's args") in line, line
    assert not (tmp_path / "new").exists()
    code, out, err = cli_inprocess(*base_args(workspace, 2, "--load", source, "--save", save))
    assert code == 0 and "nothing to train" in out, err
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()  # a folder the user made stays, empty
    code, _, err = cli_inprocess(*base_args(workspace, 2, "--load", source, "--save", tmp_path / "kept"))
    assert code == 0 and list((tmp_path / "kept").iterdir()) == []


def test_eval_iters_0_turns_validation_off_and_a_valid_split_without_share_is_warned(workspace):
    """Megatron-LM's --eval-iters 0 (it was refused) runs no validation and builds no valid split; an
    --eval-interval over a split with no valid share (silently no validation) is warned at startup."""
    code, out, err = cli_inprocess(*base_args(workspace, 2, "--eval-interval", 1, "--eval-iters", 0, split="100,0,0"))
    assert code == 0, err
    assert "validation loss" not in out and "warning" not in err
    code, out, err = cli_inprocess(*base_args(workspace, 2, "--eval-interval", 1, split="100,0,0"))
    assert code == 0, err
    assert "validation loss" not in out
    assert err.splitlines()[0] == ("hf-megatron train: warning: --eval-interval 1: no validation runs, the valid split "
                                   "of --split 100,0,0 has no share")
    code, out, err = cli_inprocess(*base_args(workspace, 2, "--eval-interval", 1, "--eval-iters", 1))
    assert code == 0 and out.count("validation loss at iteration") == 2 and "warning" not in err
    # Megatron-LM ignores a --save-interval without --save too; here it is said
    code, out, err = cli_inprocess(*base_args(workspace, 1, "--save-interval", 1))
    assert code == 0 and err.splitlines()[0] == ("hf-megatron train: warning: --save-interval 1: no checkpoint is "
                                                 "saved without --save")


def test_sft_data_without_sft_and_sequence_parallel_without_tp_are_warned(workspace, tmp_path):
    """An SFT prefix (its `_loss_mask` beside it) trained without --sft scored every token silently
    (`evaluate` warned, `train` did not); --sequence-parallel at tp 1 showed sp=on and was recorded
    in the checkpoint's args, where Megatron-LM's validate_args warns and turns it off."""
    import shutil

    from hf_megatron.checkpoint.unpickle import safe_load
    prefix = tmp_path / "chat_sft_document"
    for suffix in (".bin", ".idx"):  # a stand-in mask: the warning only looks for the file
        shutil.copy(f"{workspace / 'corpus_text_document'}{suffix}", f"{prefix}{suffix}")
        shutil.copy(f"{workspace / 'corpus_text_document'}{suffix}", f"{prefix}_loss_mask{suffix}")
    args = [a if a != workspace / "corpus_text_document" else prefix for a in base_args(workspace, 1)]
    code, out, err = cli_inprocess(*args)
    assert code == 0, err
    assert err.splitlines()[0] == (f"hf-megatron train: warning: --data-path {prefix} is an SFT dataset (it has a "
                                   "loss mask) trained as pretraining text (every token, packed windows); give --sft "
                                   "to train on response tokens only")
    code, out, err = cli_inprocess(*base_args(workspace, 1, "--sequence-parallel", "--save", tmp_path / "sp"))
    assert code == 0, err
    assert err.splitlines()[0] == ("hf-megatron train: warning: --sequence-parallel: turned off, as Megatron-LM does, "
                                   "since tensor parallelism is off (--tensor-model-parallel-size 1)")
    assert "sp=off" in out
    assert safe_load(tmp_path / "sp" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")["args"].sequence_parallel \
        is False


def test_logged_learning_rate_is_megatron_lms_lr_after_the_step(workspace, tmp_path):
    """Megatron-LM's train_step steps the scheduler after optimizer.step, then training_log prints
    optimizer.param_groups' lr: the schedule after the step (it showed the lr the step used: 0 at
    iteration 1 of a warmup).  The reference is megatron-core's own OptimizerParamScheduler, stepped by
    the global batch in samples as Megatron-LM steps it, on the CLI's log lines and TensorBoard."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    iters, gbs = 5, 4
    code, out, err = cli_inprocess(*base_args(workspace, iters, "--lr-warmup-iters", 2, "--lr-decay-iters", iters,
                                              "--lr-decay-style", "cosine", "--min-lr", 1e-4,
                                              "--tensorboard-dir", tmp_path / "tb"))
    assert code == 0, err
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2 * gbs,
                                        lr_decay_steps=iters * gbs, lr_decay_style="cosine", start_wd=0.0,
                                        end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant")
    expected = []
    for _ in range(iters):
        scheduler.step(increment=gbs)
        expected.append(optimizer.param_groups[0]["lr"])
    assert learning_rates(out) == [f"{lr:.3e}" for lr in expected]
    assert float(learning_rates(out)[0]) > 0
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    logged = [e.value for e in events.Scalars("learning-rate")]
    assert logged == pytest.approx(expected, rel=1e-6)


def test_a_load_saved_in_another_layout_names_the_reshard_command(workspace, tmp_path):
    """A checkpoint of another pp layout failed on its first missing rank folder ('rank folder missing');
    the message now says what README's 'Resume in another layout' does: the reshard command line."""
    import subprocess
    import sys

    from train_cli import env
    source = tmp_path / "pp1"
    assert _train(workspace, source, 1)[0] == 0
    done = subprocess.run([sys.executable, "-m", "hf_megatron.cli", "reshard", "--src", str(source), "--out",
                           str(tmp_path / "pp2"), "--tp", "1", "--pp", "2", "--with-optimizer"],
                          capture_output=True, text=True, env=env(), timeout=300)
    assert done.returncode == 0, done.stderr
    line = error_line(_train(workspace, tmp_path / "next", 2, "--load", tmp_path / "pp2"))
    assert line == (f"hf-megatron train: error: {tmp_path / 'pp2' / 'iter_0000001'}: saved with tp=1, pp=2 but this run "
                    "has tp=1, pp=1; reshard it first (README: Resume in another layout): `hf-megatron reshard --src "
                    f"{tmp_path / 'pp2'} --out NEW --tp 1 --pp 1 --with-optimizer`, then --load NEW")


def test_megatron_lm_flags_hf_megatron_lacks_are_named_under_the_verbs_usage(workspace, tmp_path):
    """They failed with the top-level usage ('usage: hf-megatron [-h] <verb> ...') and no hint."""
    code, _, err = cli_inprocess("--mock-data", "--seq-length", 32)  # reported before the missing --data-path
    assert code == 2 and err.startswith("usage: hf-megatron train [-h]"), err[:300]
    assert err.strip().splitlines()[-1] == ("hf-megatron train: error: unrecognized arguments: --mock-data "
                                            "(Megatron-LM's --mock-data is not supported by hf-megatron)")
    code, _, err = cli_inprocess(*base_args(workspace, 1, "--async-save", "--bogus-flag"))
    assert err.strip().splitlines()[-1] == ("hf-megatron train: error: unrecognized arguments: --async-save "
                                            "--bogus-flag (Megatron-LM's --async-save is not supported by "
                                            "hf-megatron)"), err[-500:]
    # implementation choices hf-megatron has one of: accepted, no effect
    code, _, err = _train(workspace, tmp_path / "noop", 1, "--use-mcore-models", "--transformer-impl", "local",
                          "--no-masked-softmax-fusion", "--ckpt-format", "torch", "--auto-detect-ckpt-format")
    assert code == 0, err[-2000:]
    assert sorted(p.name for p in (tmp_path / "noop" / "iter_0000001").iterdir()) == ["mp_rank_00"]


@pytest.mark.parametrize("value, expected", [
    ("zarr", "RunConfig.ckpt_format (--ckpt-format): expected one of torch, torch_dist, got 'zarr'"),
    ("fsdp_dtensor", "RunConfig.ckpt_format (--ckpt-format): expected one of torch, torch_dist, got 'fsdp_dtensor'"),
])
def test_ckpt_format_train_does_not_write_is_one_line(workspace, tmp_path, value, expected):
    line = error_line(_train(workspace, tmp_path / "out", 1, "--ckpt-format", value))
    assert line == f"hf-megatron train: error: {expected}"
    assert not (tmp_path / "out").exists()
