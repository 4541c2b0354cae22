"""--exp-avg-dtype / --exp-avg-sq-dtype bf16 (Megatron-LM's precision-aware optimizer flags): AdamW's
moments are kept in bf16 between steps, every step computes in fp32, and checkpoints hold them in fp32.

Reference: torch.optim.AdamW on fp32 copies of the weights, its moments rounded to bf16 after every
step (what Transformer Engine's FusedAdam with bf16 states does); then `hf-megatron train` as a user
runs it: the flags change the weights, the files hold fp32 moments, and a resumed run ends with the
uninterrupted run's weights bit for bit."""
import pytest
import torch
from torch import nn

from train_cli import assert_same_weights, base_args, cli_inprocess, make_workspace, weights

from hf_megatron.errors import ConfigError
from hf_megatron.parallel import state
from hf_megatron.training import TrainingConfig
from hf_megatron.training.optimizer import MixedPrecisionOptimizer

BF16, FP32 = torch.bfloat16, torch.float32


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(33, 17), nn.GELU(), nn.Linear(17, 5)).to(BF16)


@pytest.mark.parametrize("dtypes", [(BF16, BF16), (BF16, FP32)])
def test_low_precision_moments_are_fp32_steps_rounded_between_them(dtypes):
    state.initialize()
    model = _model()
    opt = MixedPrecisionOptimizer([model], lr=1e-2, weight_decay=0.1, clip_grad=0.0, moment_dtypes=dtypes)
    reference = [m.detach().clone() for m in opt.main_params]
    copy_of = {id(m): r for m, r in zip(opt.main_params, reference)}
    groups = [{"params": [copy_of[id(p)] for p in g["params"]], "weight_decay": g["weight_decay"]}
              for g in opt.optimizer.param_groups]
    ref = torch.optim.AdamW(groups, lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(6, 33, generator=gen).to(BF16)).float().pow(2).sum().backward()
        for r, g in zip(reference, opt.grads()):
            r.grad = g.float()
        assert opt.step()[0]
        ref.step()
        for entry in ref.state.values():  # stored in the configured dtypes, computed in fp32 next time
            for key, dtype in zip(("exp_avg", "exp_avg_sq"), dtypes):
                entry[key] = entry[key].to(dtype).float()
    for main, r in zip(opt.main_params, reference):
        assert torch.equal(main, r)
        mine, theirs = opt.optimizer.state[main], ref.state[r]
        for key, dtype in zip(("exp_avg", "exp_avg_sq"), dtypes):
            assert mine[key].dtype == dtype and torch.equal(mine[key].float(), theirs[key])
    sd = opt.state_dict()  # Megatron-LM's layout: moments in fp32
    moments = [v for entry in sd["optimizer"]["state"].values() for k, v in entry.items() if k.startswith("exp_avg")]
    assert moments and all(m.dtype == FP32 for m in moments)
    again = MixedPrecisionOptimizer([model], lr=1e-2, weight_decay=0.1, clip_grad=0.0, moment_dtypes=dtypes)
    again.load_state_dict(sd)  # torch's load_state_dict casts moments to fp32: kept in their dtypes again
    for main, loaded in zip(opt.main_params, again.main_params):
        for key, dtype in zip(("exp_avg", "exp_avg_sq"), dtypes):
            got = again.optimizer.state[loaded][key]
            assert got.dtype == dtype and torch.equal(got, opt.optimizer.state[main][key])
    state.reset()


def test_moment_dtype_flags_follow_megatron_lm():
    with pytest.raises(ConfigError, match=r"exp_avg_dtype \(--exp-avg-dtype bf16\): expected "
                                          "--use-precision-aware-optimizer as well"):
        TrainingConfig(bf16=True, exp_avg_dtype="bf16")
    with pytest.raises(ConfigError, match="exp_avg_sq_dtype"):
        TrainingConfig(bf16=True, exp_avg_sq_dtype="fp16")  # Megatron-LM's fp16 needs TE's scaled states
    cfg = TrainingConfig(bf16=True, use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    assert (cfg.exp_avg_dtype, cfg.exp_avg_sq_dtype) == ("bf16", "bf16")


ITERS = 6
FLAGS = ("--bf16", "--lr-decay-iters", ITERS)
LOW = ("--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16")


def _train(root, save, *extra):
    code, out, err = cli_inprocess(*base_args(root, ITERS, *FLAGS, "--save", save, *extra))
    assert code == 0, err[-2000:]
    return out


def test_train_cli_with_bf16_moments_saves_fp32_and_resumes_exactly(tmp_path):
    from hf_megatron.checkpoint.unpickle import safe_load
    root = make_workspace(tmp_path)
    _train(root, root / "fp32_moments")
    _train(root, root / "straight", *LOW)
    with pytest.raises(AssertionError):  # the flags are really on: bf16 moments move the weights
        assert_same_weights(weights(root / "straight", ITERS), weights(root / "fp32_moments", ITERS))
    payload = safe_load(root / "straight" / f"iter_{ITERS:07d}" / "mp_rank_00" / "model_optim_rng.pt")
    moments = [v for entry in payload["optimizer"]["optimizer"]["state"].values()
               for k, v in entry.items() if k.startswith("exp_avg")]
    assert moments and all(m.dtype == FP32 for m in moments)
    stopped = root / "stopped"
    _train(root, stopped, *LOW, "--exit-interval", 3)
    _train(root, stopped, *LOW, "--load", stopped)
    assert_same_weights(weights(stopped, ITERS), weights(root / "straight", ITERS))


def _dp_worker(rank, world):
    from tiny import engine_batch, tiny_hf_model
    from training_helpers import make_batches, training_config

    from hf_megatron.training import build_model, build_optimizer, build_scheduler, setup_parallel, split_batch, \
        train_step
    out = {}
    for zero in (False, True):
        cfg = training_config({"dp": 2, "zero": zero}, use_precision_aware_optimizer=True, exp_avg_dtype="bf16",
                              exp_avg_sq_dtype="bf16")
        setup_parallel(cfg)
        chunks = build_model(tiny_hf_model("llama"), cfg)
        opt = build_optimizer(chunks, cfg)
        scheduler = build_scheduler(opt, cfg)
        losses = [train_step(chunks, opt, scheduler, split_batch(engine_batch(b), cfg))["loss"]
                  for b in make_batches(4)]
        dtypes = {v.dtype for entry in opt.optimizer.state.values() for k, v in entry.items() if k != "step"}
        gathered = opt.parameter_state() if zero else None
        out[zero] = {"losses": losses, "dtypes": dtypes,
                     "gathered": None if gathered is None else {gathered["exp_avg"].dtype, gathered["exp_avg_sq"].dtype}}
        state.reset()
    return out


def test_bf16_moments_with_the_distributed_optimizer():
    """dp 2: the distributed optimizer keeps its shards' moments in bf16, tracks the plain dp optimizer
    (its grad-norm summation order differs: rel 1e-5) and gathers fp32 moments for distrib_optim.pt."""
    from dist import run_distributed
    for rank, out in enumerate(run_distributed(_dp_worker, 2)):
        assert out[False]["dtypes"] == out[True]["dtypes"] == {BF16}, rank
        assert out[True]["gathered"] == ({FP32} if rank == 0 else None)
        for a, b in zip(out[True]["losses"], out[False]["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b)
