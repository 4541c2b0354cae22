"""GradBuffer without overlap: gradients are added into the fp32 main grads when each backward
pass ends (one queued engine callback), not from a hook per parameter.  Checked against plain
autograd on the same bf16 module: main_grad == sum over micro batches of that micro batch's bf16
`.grad` (each added in fp32), `.grad` freed after every backward, and a backward that raised
does not leave later backward passes unfolded."""
from __future__ import annotations

import copy

import pytest
import torch

from hf_megatron.parallel.grad_buffer import GradBuffer


def _module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 3)).to(torch.bfloat16)


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, generator=g).to(torch.bfloat16) for _ in range(n)]


def _reference_main_grads(module, batches):
    """Per micro batch: the bf16 grads plain autograd gives, summed in fp32."""
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in module.parameters()]
    for x in batches:
        module.zero_grad(set_to_none=True)
        module(x).float().square().sum().backward()
        for s, p in zip(sums, module.parameters()):
            s += p.grad.float()
    return sums


def test_main_grads_sum_each_backward_in_fp32_and_grads_are_freed():
    module, batches = _module(), _batches(3)
    expected = _reference_main_grads(copy.deepcopy(module), batches)
    buffer = GradBuffer([module], list(module.parameters()))
    assert not buffer.per_param
    buffer.zero()
    for x in batches:
        module(x).float().square().sum().backward()
        assert all(p.grad is None for p in module.parameters())  # folded when the backward ended
    buffer.finish()
    for p, want in zip(module.parameters(), expected):
        assert p.main_grad.dtype == torch.float32
        torch.testing.assert_close(p.main_grad, want, rtol=0, atol=0)


def test_a_backward_that_raised_does_not_stop_later_folds():
    module, batches = _module(), _batches(2)
    expected = _reference_main_grads(copy.deepcopy(module), batches[1:])
    buffer = GradBuffer([module], list(module.parameters()))

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, dy):
            raise RuntimeError("boom")

    buffer.zero()
    out = Boom.apply(module[0](batches[0])).sum() + module[2](module[1](module[0](batches[0]))).sum()
    with pytest.raises(RuntimeError, match="boom"):
        out.backward()  # (the output layer's grads may have landed before Boom's backward raised)
    module.zero_grad(set_to_none=True)
    buffer.zero()
    module(batches[1]).float().square().sum().backward()
    assert all(p.grad is None for p in module.parameters())
    buffer.finish()
    for p, want in zip(module.parameters(), expected):
        torch.testing.assert_close(p.main_grad, want, rtol=0, atol=0)


@pytest.mark.parametrize("backwards", [1, 2, 3])
def test_lazy_buffer_waits_for_a_second_backward_with_the_same_sums(backwards):
    """lazy=True: after one backward nothing is allocated and `gradients()` are plain autograd's
    bf16 grads (their fp32 sum is themselves); a second backward allocates the buffer, which then
    holds the same fp32 sums as an eager buffer, bit for bit, and stays allocated."""
    module, batches = _module(), _batches(backwards)
    expected = _reference_main_grads(copy.deepcopy(module), batches)
    params = list(module.parameters())
    buffer = GradBuffer([module], params, lazy=True)
    for step in range(2):
        buffer.zero()
        for x in batches:
            module(x).float().square().sum().backward()
            assert all(p.grad is None for p in params)
        buffer.finish()
        got = buffer.gradients(params)
        if backwards == 1:
            assert buffer.data is None and not hasattr(params[0], "main_grad")
            assert [g.dtype for g in got] == [torch.bfloat16] * len(params)
        else:
            assert buffer.data is not None and all(g.dtype == torch.float32 for g in got)
        for g, want in zip(got, expected):
            torch.testing.assert_close(g.float(), want, rtol=0, atol=0)


def test_lazy_buffer_gives_zeros_for_a_param_without_gradient():
    module = _module()
    params = list(module.parameters())
    buffer = GradBuffer([module], params, lazy=True)
    buffer.zero()
    module[0](_batches(1)[0]).float().sum().backward()  # the second linear gets no gradient
    buffer.finish()
    got = buffer.gradients(params)
    assert got[0].abs().sum() > 0 and all(g.abs().sum() == 0 and g.shape == p.shape for g, p in zip(got[2:], params[2:]))


def test_lazy_needs_one_dp_rank_and_unsharded_params():
    module = _module()
    with pytest.raises(ValueError, match="lazy allocation needs dp = 1"):
        GradBuffer([module], list(module.parameters()), lazy=True, shard_params=True)
