"""The fused cross-entropy kernel (csrc/cross_entropy.cu) vs PyTorch's F.cross_entropy on the fp32
upcast of the same logits (GPU only; skipped without CUDA).

Both sides compute in fp32 from the same inputs, in different orders: losses agree norm-wise to 1e-5;
logit gradients are the fp32 values rounded once to the logits' dtype on both sides, so they agree
to 1 ulp (bf16 2^-7, fp16 2^-10; fp32 1e-5 relative) plus a small absolute slack for near-zero
probabilities.
"""
import pytest
import torch
import torch.nn.functional as F

from hf_megatron import kernels
from hf_megatron.kernels import cross_entropy as ce
from tiny import VOCAB, local_grads, rel_err, tiny_hf_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

IGNORE = -100
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 1e-5}


@pytest.fixture(scope="module", autouse=True)
def extension():
    assert kernels.load_extension() is not None, "the CUDA extension failed to build (see the warning above)"


@pytest.fixture
def calls(monkeypatch):
    """Counts the fused Function's calls, so a test fails if the dispatcher silently fell back."""
    seen = []
    original = ce.FusedCrossEntropy.apply
    monkeypatch.setattr(ce.FusedCrossEntropy, "apply", lambda *a: seen.append(a[-1]) or original(*a))
    return seen


def _inputs(rows, width, vocab, dtype, seed, ignored=0.25):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(rows, width, generator=gen, device="cuda") * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen, device="cuda")
    targets[torch.rand(rows, generator=gen, device="cuda") < ignored] = IGNORE
    probe = torch.rand(rows, generator=gen, device="cuda") + 0.5
    return logits, targets, probe


def _loss_and_grad(fn, logits, probe, **kw):
    base = logits.detach().clone().requires_grad_()
    work = base * 1  # not a leaf: the in-place gradient may then reuse its buffer
    loss = fn(work, **kw)
    (loss * probe).sum().backward()
    return loss.detach(), base.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,width,vocab", [
    (7, 1000, 1000),         # vectorised, no padding
    (33, 50304, 50257),      # GPT-2's padded vocabulary: the last pack is part classes, part padding
    (5, 40, 37),             # tiny
    (3, 129, 129),           # width not a multiple of the pack: the scalar path
    (64, 128256, 128256),    # Llama-3's vocabulary
])
@pytest.mark.parametrize("in_place", [False, True])
def test_fused_cross_entropy_matches_torch(calls, dtype, rows, width, vocab, in_place):
    logits, targets, probe = _inputs(rows, width, vocab, dtype, seed=rows + width)
    loss, grad = _loss_and_grad(lambda z: ce.cross_entropy(z, targets, vocab, IGNORE, grad_into_logits=in_place),
                                logits, probe)
    ref_loss, ref_grad = _loss_and_grad(
        lambda z: F.cross_entropy(z[:, :vocab].float(), targets, ignore_index=IGNORE, reduction="none"), logits, probe)
    assert calls == [in_place], "the kernel was not used"
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert rel_err(loss, ref_loss) <= 1e-5
    assert torch.equal(loss[targets == IGNORE], torch.zeros_like(loss[targets == IGNORE]))
    torch.testing.assert_close(grad, ref_grad, rtol=ULP[dtype], atol=ULP[dtype] * 1e-3)
    assert torch.count_nonzero(grad[:, vocab:]) == 0 and torch.count_nonzero(grad[targets == IGNORE]) == 0


def test_gradient_written_into_the_logits_buffer():
    logits, targets, probe = _inputs(16, 2048, 2000, torch.bfloat16, seed=3)
    base = logits.clone().requires_grad_()
    work = base * 1
    storage = work.untyped_storage().data_ptr()
    (ce.cross_entropy(work, targets, 2000, IGNORE, grad_into_logits=True) * probe).sum().backward()
    assert work.untyped_storage().data_ptr() == storage
    assert torch.equal(work.detach(), base.grad)  # the logits now hold their gradient
    ref = base.detach().clone().requires_grad_()
    (F.cross_entropy(ref[:, :2000].float(), targets, ignore_index=IGNORE, reduction="none") * probe).sum().backward()
    torch.testing.assert_close(base.grad, ref.grad, rtol=ULP[torch.bfloat16], atol=1e-6)


def test_in_place_gradient_refuses_logits_another_op_saved():
    """sin saves its input; autograd runs the later-recorded loss first, whose gradient then overwrites
    that input: sin's backward must raise, not differentiate the overwritten values.  (Had sin's
    backward run first, it would have used the values before they changed.)"""
    logits, targets, _ = _inputs(4, 256, 256, torch.bfloat16, seed=5)
    work = logits.clone().requires_grad_() * 1
    saved_by_sin = work.sin()
    total = ce.cross_entropy(work, targets, 256, IGNORE, grad_into_logits=True).sum() + saved_by_sin.sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        total.backward()


def test_nan_and_inf_logits_propagate_like_torch():
    logits, targets, _ = _inputs(4, 512, 512, torch.float32, seed=9, ignored=0.0)
    logits[1, 7] = float("nan")
    logits[2, :] = float("-inf")
    logits[2, 3] = 1.0  # one finite class: loss 0 or inf, as torch's
    loss = ce.cross_entropy(logits, targets, 512, IGNORE)
    ref = F.cross_entropy(logits, targets, reduction="none")
    torch.testing.assert_close(loss, ref, equal_nan=True, rtol=1e-5, atol=1e-6)


def test_one_upstream_gradient_for_all_rows(calls):
    """A mean over tokens hands backward an expanded (stride-0) gradient."""
    logits, targets, _ = _inputs(9, 300, 290, torch.bfloat16, seed=11)
    mine = logits.clone().requires_grad_()
    ce.cross_entropy(mine * 1, targets, 290, IGNORE).mean().backward()
    ref = logits.clone().requires_grad_()
    F.cross_entropy(ref[:, :290].float(), targets, ignore_index=IGNORE, reduction="none").mean().backward()
    assert calls
    torch.testing.assert_close(mine.grad, ref.grad, rtol=ULP[torch.bfloat16], atol=1e-6)


@pytest.mark.parametrize("compile_model", [False, True])
def test_model_loss_uses_the_kernel_and_tracks_the_fallback(monkeypatch, calls, compile_model):
    """GPTModel's training loss (no logits returned: the gradient reuses their buffer), fp32 weights,
    eager and regionally compiled: loss and every gradient vs HF_MEGATRON_KERNELS=0."""
    import hf_megatron
    from hf_megatron.parallel.compile import apply_compile

    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1)).cuda()
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv("HF_MEGATRON_KERNELS", switch)
        model = hf_megatron.from_pretrained(tiny_hf_model("llama")).to(device="cuda")
        if compile_model:
            torch._dynamo.reset()
            apply_compile(model)
        out = model(ids, targets=ids, return_logits=False)
        out.loss.backward()
        results.append((out.loss.detach(), local_grads(model)))
    (loss, grads), (ref_loss, ref_grads) = results
    assert calls and calls[0] is True, "the model's loss did not use the in-place kernel"
    assert rel_err(loss, ref_loss) <= 1e-5
    for name in ref_grads:
        assert rel_err(grads[name], ref_grads[name]) <= 1e-4, name
