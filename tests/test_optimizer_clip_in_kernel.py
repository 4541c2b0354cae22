"""Clipping folded into torch's fused AdamW (its `grad_scale`) equals clipping the grads first.

The reference is torch's own AdamW (unfused, per-tensor loop) stepped on fp32 copies of the main
weights with grads explicitly multiplied by clip / (||g|| + 1e-6).  On CPU the optimizer's inner
AdamW is rebuilt with fused=True (torch has a fused CPU AdamW) so the folded path runs here too;
on CUDA it is the default."""
import pytest
import torch
from torch import nn

from hf_megatron.parallel import state
from hf_megatron.training.optimizer import MixedPrecisionOptimizer

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clip", [0.05, 1e9])  # clipping active / inactive
def test_clip_in_fused_adamw_equals_clip_then_step(device, clip):
    state.initialize()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(67, 45), nn.GELU(), nn.Linear(45, 31)).to(device, torch.bfloat16)
    opt = MixedPrecisionOptimizer([model], lr=1e-2, weight_decay=0.1, clip_grad=clip)
    if device == "cpu":
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in opt.optimizer.param_groups]
        opt.optimizer = torch.optim.AdamW(groups, lr=1e-2, fused=True)
    assert all(g["fused"] for g in opt.optimizer.param_groups)
    ref_params = [m.detach().clone() for m in opt.main_params]
    ref_groups = [{"params": ref_params[:2], "weight_decay": 0.1}, {"params": ref_params[2:], "weight_decay": 0.0}]
    assert [p.ndim for p in opt.model_params] == [2, 2, 1, 1]  # decay group first, then biases
    ref = torch.optim.AdamW(ref_groups, lr=1e-2, foreach=False)
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(8, 67, device=device, dtype=torch.bfloat16)
        (model(x).float().pow(2).sum() * 10).backward()
        grads = [g.detach().float() for g in opt.grads()]  # bf16 while the grad buffer is lazy
        norm = torch.stack([g.double().norm() for g in grads]).pow(2).sum().sqrt().item()
        updated, reported = opt.step()
        assert updated and reported == pytest.approx(norm, rel=1e-6)
        coeff = min(1.0, clip / (norm + 1e-6))
        for p, g in zip(ref_params, grads):
            p.grad = g * coeff
        ref.step()
        for mine, theirs in zip(opt.main_params, ref_params):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        assert not hasattr(opt.optimizer, "grad_scale")  # not left behind for the next step


def _fused_optimizer(model, clip):
    opt = MixedPrecisionOptimizer([model], lr=1e-2, weight_decay=0.1, clip_grad=clip)
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in opt.optimizer.param_groups]
    opt.optimizer = torch.optim.AdamW(groups, lr=1e-2, fused=True)
    return opt


def test_non_finite_gradient_skips_the_queued_step_on_the_device():
    """launch_step reads nothing on the host; a NaN gradient makes the fused kernel skip the update
    and the step count (its found_inf), and finish_step reports the skip like the host path."""
    state.initialize()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.GELU(), nn.Linear(8, 4)).to(torch.bfloat16)
    opt = _fused_optimizer(model, clip=1.0)
    for poison in (False, True):
        opt.zero_grad()
        (model(torch.randn(4, 16, dtype=torch.bfloat16)).float().pow(2).sum()).backward()
        if poison:
            opt.grads()[0].view(-1)[3] = float("nan")
        before = [m.detach().clone() for m in opt.main_params]
        steps = [opt.optimizer.state[m]["step"].item() if m in opt.optimizer.state else 0 for m in opt.main_params]
        launched = opt.launch_step()
        assert isinstance(launched, torch.Tensor) and launched.shape == (2,)  # queued: nothing read yet
        updated, norm = opt.finish_step(launched)
        after = [opt.optimizer.state[m]["step"].item() for m in opt.main_params]
        if poison:
            assert (updated, norm) == (False, None) and after == steps
            for m, b in zip(opt.main_params, before):
                torch.testing.assert_close(m, b, rtol=0, atol=0)
        else:
            assert updated and norm > 0 and after == [s + 1 for s in steps]
        assert not hasattr(opt.optimizer, "found_inf") and not hasattr(opt.optimizer, "grad_scale")


def test_train_step_with_the_queued_update_equals_the_host_path():
    """trainer.train_step over 3 steps: fused AdamW queued without a host sync (one read of loss,
    tokens and norm) against the same fused AdamW driven by the host path (launch_step forced to
    decide on the host): same losses, norms and weights."""
    from hf_megatron.training.trainer import train_step
    from hf_megatron.training import TrainingConfig, build_model, setup_parallel
    from tiny import engine_batch, tiny_hf_model
    from training_helpers import GLOBAL_BATCH, make_batches
    cfg = TrainingConfig(micro_batch_size=GLOBAL_BATCH, global_batch_size=GLOBAL_BATCH, bf16=True, clip_grad=0.05)
    runs = []
    for host in (False, True):
        setup_parallel(cfg)
        chunks = build_model(tiny_hf_model("llama"), cfg)
        opt = _fused_optimizer(chunks[0], clip=0.05)
        if host:
            opt.launch_step = torch.no_grad()(lambda opt=opt: opt._step_on_host(opt._main_grads()))
        out = [train_step(chunks, opt, None, [engine_batch(mb)]) for mb in make_batches(3)]
        runs.append((out, [m.detach().clone() for m in opt.main_params]))
        state.reset()
    (queued, weights_q), (host, weights_h) = runs
    for a, b in zip(queued, host):
        assert a["loss"] == b["loss"] and not a["skipped"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-12)
    for a, b in zip(weights_q, weights_h):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
