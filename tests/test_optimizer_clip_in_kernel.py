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
        grads = [g.detach().clone() for g in opt.grads()]
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
