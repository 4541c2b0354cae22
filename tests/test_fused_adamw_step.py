"""training/fused_adamw.torch_step_: torch's fused AdamW kernel called directly (no `.grad` set and
cleared per param, no per-call grouping) gives what `optimizer.step()` gives, bit for bit: weights,
moments and step counts over clipped steps (grad_scale) and a skipped one (found_inf).  On CPU with
torch's fused CPU AdamW; the optimizer's other paths are tests/test_optimizer_clip_in_kernel.py's."""
import pytest
import torch
from torch import nn

from hf_megatron.parallel import state
from hf_megatron.training import fused_adamw
from hf_megatron.training.optimizer import MixedPrecisionOptimizer


def _run(direct: bool, monkeypatch):
    state.initialize()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(33, 17), nn.GELU(), nn.Linear(17, 5)).to(torch.bfloat16)
    opt = MixedPrecisionOptimizer([model], lr=1e-2, weight_decay=0.1, clip_grad=0.05)
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in opt.optimizer.param_groups]
    opt.optimizer = torch.optim.AdamW(groups, lr=1e-2, fused=True)
    calls = []
    with monkeypatch.context() as patch:
        real = fused_adamw.torch_step_
        patch.setattr(fused_adamw, "torch_step_", lambda *a: calls.append(direct and real(*a)) or calls[-1])
        gen = torch.Generator().manual_seed(1)
        for step in range(4):
            opt.zero_grad()
            model(torch.randn(6, 33, generator=gen).to(torch.bfloat16)).float().pow(2).sum().backward()
            if step == 2:
                opt.grads()[1].view(-1)[0] = float("nan")
            updated, _ = opt.step()
            assert updated == (step != 2)
    assert calls == [direct] * 4  # the direct call ran (True) or was refused (the optimizer's step ran)
    out = [m.detach().clone() for m in opt.main_params], [p.detach().clone() for p in model.parameters()]
    moments = [{k: v.clone() for k, v in opt.optimizer.state[m].items()} for m in opt.main_params]
    state.reset()
    return out, moments


def test_direct_fused_adamw_equals_optimizer_step(monkeypatch):
    (mains_d, model_d), state_d = _run(True, monkeypatch)
    (mains_s, model_s), state_s = _run(False, monkeypatch)
    for a, b in zip(mains_d + model_d, mains_s + model_s):
        assert torch.equal(a, b)
    for a, b in zip(state_d, state_s):
        assert a.keys() == b.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert a["step"].item() == 3  # the NaN step was skipped


def test_direct_call_only_for_plain_fused_adamw():
    params = [nn.Parameter(torch.randn(3))]
    grads = [torch.randn(3)]
    assert not fused_adamw.torch_step_(torch.optim.AdamW(params, foreach=False), params, grads)
    assert not fused_adamw.torch_step_(torch.optim.AdamW(params, fused=True, amsgrad=True), params, grads)
    assert not fused_adamw.torch_step_(torch.optim.AdamW(params, fused=True), params, [grads[0].double()])
    assert fused_adamw.torch_step_(torch.optim.AdamW(params, fused=True), params, grads)


def test_sum_of_squares_without_the_kernel_is_an_fp64_sum():
    """kernels.adamw.sum_of_squares off CUDA (or kernel=False): torch's fp64 per-tensor norms, squared
    and summed -- any dtype mix, empty tensors skipped (the lazy buffer's norm over unequal dtypes)."""
    from hf_megatron.kernels.adamw import sum_of_squares
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(257, generator=gen).to(torch.bfloat16), torch.randn(3, 5, generator=gen), torch.zeros(0)]
    want = sum(t.double().square().sum() for t in tensors)
    got = sum_of_squares(tensors, kernel=False)
    assert got.dtype == torch.float64 and got.shape == ()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert sum_of_squares([], kernel=False).item() == 0.0


def _one_step(precision_aware):
    state.initialize()
    model = nn.Linear(8, 4).to(torch.bfloat16)
    opt = MixedPrecisionOptimizer([model], lr=1e-2, precision_aware=precision_aware)
    model(torch.randn(2, 8).to(torch.bfloat16)).float().sum().backward()
    updated, _ = opt.step()
    state.reset()
    return updated


def test_csrc_adamw_is_tried_silently_by_default_and_warns_only_when_asked(monkeypatch, recwarn):
    """precision_aware None (the default): csrc's AdamW where it can run, silently elsewhere (here:
    CPU tensors, no build attempted); True (--use-precision-aware-optimizer) warns once that torch's
    AdamW steps instead; False never asks."""
    from hf_megatron.kernels import adamw as kernel
    built = []
    monkeypatch.setattr(kernel, "load_extension", lambda: built.append(1))
    monkeypatch.setattr(fused_adamw, "_warned", False)
    assert _one_step(None) and _one_step(False)
    assert not [w for w in recwarn if "precision-aware" in str(w.message)] and not built
    with pytest.warns(RuntimeWarning, match="--use-precision-aware-optimizer: csrc's AdamW needs CUDA tensors"):
        assert _one_step(True)
    assert not built  # CPU tensors are refused before the extension is looked at
