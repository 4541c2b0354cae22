"""`hf-megatron reshard --with-optimizer` output resumed by megatron-core 0.16.1, as Megatron-LM's
load_checkpoint (torch format) resumes it.

Our run (`hf-megatron train`, the hyper-parameters and data of tests/test_megatron_optimizer.py) saves
iteration K and goes on to K+2; the reshard of iteration K is loaded by megatron-core at the new layout,
which takes steps K+1 and K+2 on the same samples: its losses are our run's, and the state it loaded
(through its own accessors) is, name by name, the state our reader takes from the same resharded files.

* distributed target: our tp 2 run (plain optimizer) resharded to tp 1 with --use-distributed-optimizer
  --overlap-grad-reduce --ddp-bucket-size (several buckets); megatron-core's DDP + DistributedOptimizer
  built from the resharded args, `load_state_dict` + `load_parameter_state` (tests/
  test_megatron_distrib_optim.py's `_megatron_core_resumes_ours`, unchanged).
* plain target: our bf16 run with the distributed optimizer resharded with --no-use-distributed-optimizer;
  megatron-core's Float16OptimizerWithFloat16Params (what Megatron-LM's get_megatron_optimizer builds for
  bf16 without --use-distributed-optimizer) `load_state_dict`s the optimizer entry, its
  OptimizerParamScheduler the scheduler entry (with its equality checks on).  The state our reader takes
  from the source's distrib_optim.pt and from the resharded entry are the same, exactly.
* Megatron-LM's own load_checkpoint (only with a core_v0.16.1 checkout, HF_MEGATRON_MEGATRON_LM; CI has
  none) of our tp 2 run resharded to tp 1 with a plain optimizer.
* The scheduler entry: megatron-core's OptimizerParamScheduler, built with Megatron-LM's values for our
  flags, loads it with its checks on (the weight-decay keys included) and refuses another horizon.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from dist import run_distributed
from hf_megatron.checkpoint.unpickle import safe_load
from test_megatron_distrib_optim import _megatron_core_resumes_ours, _whole, assert_same_state, our_loaded_optimizer
from test_megatron_optimizer import (GBS, K, PADDED_VOCAB, _cpu_stand_ins, mcore_model, megatron_core_optimizer,
                                     megatron_core_scheduler, megatron_core_state, megatron_lm_train_step,
                                     next_two_losses, our_state, resume_flags)
from megatron_lm_checkout import requires_megatron_lm
from test_reshard_optimizer import losses, run_train


def _our_run(tmp_path: Path, arch: str, dtype: str, world: int, *layout, name: str = "ours"
             ) -> tuple[Path, dict[int, float]]:
    """`hf-megatron train` to K+2 on `world` processes, saved at K into <tmp_path>/<name>: (that folder,
    its losses)."""
    from test_convert_helpers import save_hf
    from train_cli import make_workspace
    make_workspace(tmp_path)
    save_hf(tmp_path / "hf", arch, vocab_size=PADDED_VOCAB)
    save = tmp_path / name
    run_train(world, "--hf-model", tmp_path / "hf", *resume_flags(tmp_path, dtype), "--train-iters", K + 2,
              *layout, "--save", save, "--save-interval", K, "--tensorboard-dir", save / "tb")
    return save, losses(save / "tb")


def _reshard(save: Path, out: Path, tp: int, *flags) -> None:
    from hf_megatron import cli
    assert cli.main(["reshard", "--src", str(save / f"iter_{K:07d}"), "--out", str(out), "--tp", str(tp), "--pp", "1",
                     "--with-optimizer", *map(str, flags)]) == 0


def _assert_next_losses(theirs: list[float], ours: dict[int, float], tolerance: float) -> None:
    print(f"relative loss differences: {abs(theirs[0] - ours[K + 1]) / ours[K + 1]:.1e}, "
          f"{abs(theirs[1] - ours[K + 2]) / ours[K + 2]:.1e}")
    assert theirs[0] == pytest.approx(ours[K + 1], rel=tolerance)  # the resharded weights
    assert theirs[1] == pytest.approx(ours[K + 2], rel=tolerance)  # one update with the resharded moments


def test_megatron_core_distributed_optimizer_resumes_a_resharded_checkpoint(tmp_path):
    from hf_megatron.parallel import state
    save, ours = _our_run(tmp_path, "qwen2", "fp32", 2, "--tensor-model-parallel-size", 2)
    out = tmp_path / "tp1_distributed"
    _reshard(save, out, 1, "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", 20000)
    rank_dir = out / f"iter_{K:07d}" / "mp_rank_00"
    args = safe_load(rank_dir / "model_optim_rng.pt")["args"]
    assert (args.use_distributed_optimizer, args.overlap_grad_reduce, args.ddp_bucket_size) == (True, True, 20000)
    assert (rank_dir / "distrib_optim.pt").is_file()
    theirs, shards, buckets, groups = run_distributed(_megatron_core_resumes_ours, 1, (str(out), str(tmp_path)))[0]
    assert buckets[0] > 2 and [wd for wd, *_ in groups] == [1.0, 0.0]
    _, chunks, optimizer = our_loaded_optimizer(out, "qwen2", "fp32", distributed=True)
    mine = our_state(chunks[0], optimizer)
    state.reset()
    assert_same_state(mine, _whole([shards]))
    _assert_next_losses(theirs, ours, 1e-6)  # measured (K+1, K+2): 0, 8e-8


def _megatron_core_plain_resumes(rank, world, folder, root):
    """Megatron-LM's load_checkpoint (torch format, no --use-distributed-optimizer) of iteration K in `folder`:
    model.load_state_dict, optimizer.load_state_dict, opt_param_scheduler.load_state_dict (its checks on);
    then (its optimizer's class, its state by name, its losses at K+1 and K+2)."""
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    _cpu_stand_ins()
    payload = safe_load(Path(folder) / f"iter_{K:07d}" / "mp_rank_00" / "model_optim_rng.pt")
    model = mcore_model(payload["args"])
    loaded = getattr(model, "module", model).load_state_dict(payload["model"], strict=False)
    assert not loaded.unexpected_keys and all(k.endswith("_extra_state") for k in loaded.missing_keys)
    optimizer = megatron_core_optimizer(model, payload["args"])
    optimizer.load_state_dict(copy.deepcopy(payload["optimizer"]))
    scheduler = megatron_core_scheduler(optimizer)
    scheduler.use_checkpoint_opt_param_scheduler = False  # Megatron-LM's default: every saved value asserted
    scheduler.load_state_dict(payload["opt_param_scheduler"])
    assert scheduler.num_steps == K * GBS
    saved = megatron_core_state(model, optimizer)
    losses_ = next_two_losses(Path(root), megatron_lm_train_step(model, optimizer, scheduler), model)
    parallel_state.destroy_model_parallel()
    return type(optimizer).__name__, saved, losses_


def test_megatron_core_float16_optimizer_resumes_a_resharded_distributed_run(tmp_path):
    import torch
    from hf_megatron.parallel import state
    save, ours = _our_run(tmp_path, "llama", "bf16", 1, "--use-distributed-optimizer")
    _, chunks, optimizer = our_loaded_optimizer(save, "llama", "bf16", distributed=False, iteration=K)
    before = our_state(chunks[0], optimizer)  # what our reader takes from the source's distrib_optim.pt
    state.reset()
    out = tmp_path / "plain"
    _reshard(save, out, 1, "--no-use-distributed-optimizer")
    rank_dir = out / f"iter_{K:07d}" / "mp_rank_00"
    payload = safe_load(rank_dir / "model_optim_rng.pt")
    assert not (rank_dir / "distrib_optim.pt").exists() and not hasattr(payload["args"], "use_distributed_optimizer")
    assert sorted(payload["optimizer"]) == ["fp32_from_fp16_params", "optimizer"]
    assert payload["opt_param_scheduler"]["wd_incr_steps"] == (K + 2) * GBS  # megatron-core checks it on load
    kind, theirs, next_losses = run_distributed(_megatron_core_plain_resumes, 1, (str(out), str(tmp_path)))[0]
    assert kind == "Float16OptimizerWithFloat16Params"
    _, chunks, optimizer = our_loaded_optimizer(out, "llama", "bf16", distributed=False)
    after = our_state(chunks[0], optimizer)
    state.reset()
    assert sorted(before) == sorted(after) == sorted(theirs)
    for name, (step, exp_avg, exp_avg_sq, main) in theirs.items():
        for got in (before[name], after[name]):
            assert got[0] == step == float(K), name
            assert torch.equal(got[1], exp_avg) and torch.equal(got[2], exp_avg_sq), name
            assert torch.equal(got[3], main), name
    _assert_next_losses(next_losses, ours, 1e-3)  # bf16, two implementations' rounding: measured 2.1e-5, 2.9e-5


def test_megatron_core_scheduler_loads_our_entry_with_its_checks_on():
    """Our run's opt_param_scheduler (trainer.build_scheduler) holds megatron-core's weight-decay keys with
    the values Megatron-LM's get_optimizer_param_scheduler gives the same flags; its load_state_dict
    (override and use-checkpoint off: every key asserted equal) takes it, and refuses another horizon."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from hf_megatron.parallel import state
    from hf_megatron.training import build_scheduler, setup_parallel
    from training_helpers import training_config
    import dataclasses
    cfg = dataclasses.replace(training_config({}, weight_decay=0.03, lr_decay_iters=6, lr_warmup_iters=2), train_iters=7)
    setup_parallel(cfg)
    gbs = cfg.micro_batch_size * cfg.num_micro_batches()
    ours = build_scheduler(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]), cfg)
    state.reset()
    for _ in range(3):
        ours.step()
    saved = ours.state_dict()

    def megatron_lm(train_iters):  # get_optimizer_param_scheduler with --train-iters, constant weight decay
        return OptimizerParamScheduler(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]), init_lr=0.0,
                                       max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=cfg.warmup_iters * gbs,
                                       lr_decay_steps=cfg.lr_decay_iters * gbs, lr_decay_style=cfg.lr_decay_style,
                                       start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
                                       wd_incr_steps=train_iters * gbs, wd_incr_style="constant",
                                       use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False)
    theirs = megatron_lm(cfg.train_iters)
    theirs.load_state_dict(saved)
    assert theirs.num_steps == 3 * gbs and theirs.get_wd() == cfg.weight_decay
    assert theirs.state_dict() == saved
    with pytest.raises(AssertionError, match="weight decay iterations"):
        megatron_lm(cfg.train_iters + 1).load_state_dict(saved)


@requires_megatron_lm
def test_megatron_lms_own_load_checkpoint_resumes_a_resharded_checkpoint(tmp_path):
    """Megatron-LM's own load_checkpoint (a core_v0.16.1 checkout: HF_MEGATRON_MEGATRON_LM) of our tp 2 run
    resharded to tp 1 with a plain optimizer: its scheduler checks pass, its Adam state is what our reader
    takes, its next two losses are our run's."""
    import torch
    from test_megatron_lm_training import _megatron_lm_loads_ours, _our_optimizer_state
    _, ours = _our_run(tmp_path, "gpt2", "fp32", 2, "--tensor-model-parallel-size", 2, name="ours_tp2")
    _reshard(tmp_path / "ours_tp2", tmp_path / "ours", 1)  # where _megatron_lm_loads_ours reads
    got = run_distributed(_megatron_lm_loads_ours, 1, (str(tmp_path), "fp32"))[0]
    assert got["iteration"] == K and got["consumed_train_samples"] == K * GBS
    saved = safe_load(tmp_path / "ours" / f"iter_{K:07d}" / "mp_rank_00" / "model_optim_rng.pt")
    assert {k: got["scheduler"][k] for k in saved["opt_param_scheduler"]} == saved["opt_param_scheduler"]
    mine = _our_optimizer_state(tmp_path / "ours", "gpt2", "fp32")
    assert sorted(mine) == sorted(got["state"])
    for name, (step, exp_avg, exp_avg_sq, main) in got["state"].items():
        assert step == mine[name][0] == float(K), name
        assert torch.equal(exp_avg, mine[name][1]) and torch.equal(exp_avg_sq, mine[name][2]), name
        assert torch.equal(main, mine[name][3]), name
    _assert_next_losses(got["losses"], ours, 1e-6)
