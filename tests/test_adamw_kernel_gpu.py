"""csrc/adamw.cu against torch's fused AdamW, and the optimizer's kernel path against its torch
path (GPU only; skipped without CUDA).

Reference: torch.optim.AdamW(fused=True) stepping fp32 copies of the same weights with the same
grads widened to fp32 (the fp32 main grads of one backward are exactly that).  The kernel uses the
reference kernel's scalar types and order of operations; tolerance 2 fp32 ulp (rtol 2^-22, and
atol 1e-6 for weights that the update brought near zero) for a compiler contracting an expression
differently, and the bf16 model copy must equal the
updated main weight rounded to bf16 bit for bit.  Sizes: empty, odd, one chunk + 1, a view at an
odd offset (the unaligned path), several chunks."""
import pytest
import torch
from torch import nn

from hf_megatron import kernels
from hf_megatron.kernels import adamw as kernel
from hf_megatron.parallel import state
from hf_megatron.training import fused_adamw
from hf_megatron.training.optimizer import MixedPrecisionOptimizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SIZES = [0, 1, 3, 4, 4097, kernel.CHUNK + 1, 3 * kernel.CHUNK + 8]
RTOL, ATOL = 2.0 ** -22, 1e-6  # 2 ulp; near zero, 1e-6 = a few ulp of the O(1) weight before the update


@pytest.fixture(scope="module", autouse=True)
def extension():
    assert kernels.load_extension() is not None, "the CUDA extension failed to build (see the warning above)"


def _tensors(seed, grad_dtype, unaligned=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mains, grads = [], []
    for n in SIZES:
        base = torch.randn(n + 1, generator=gen, device="cuda")
        mains.append(base[1:] if unaligned else base[:n].clone())
        grads.append((torch.randn(n, generator=gen, device="cuda") * 1e-2).to(grad_dtype))
    return mains, grads


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("unaligned", [False, True])
@pytest.mark.parametrize("clip", [False, True])
def test_kernel_steps_like_torch_fused_adamw(grad_dtype, unaligned, clip):
    mains, _ = _tensors(0, grad_dtype, unaligned)
    ref_params = [m.detach().clone() for m in mains]
    ref = torch.optim.AdamW(ref_params, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    opt = torch.optim.AdamW(mains, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    models = [m.to(torch.bfloat16) for m in mains]
    for step in range(3):
        _, grads = _tensors(step + 1, grad_dtype)
        scale = torch.full((1,), 3.5, device="cuda") if clip else None
        found = torch.zeros((), device="cuda")
        assert fused_adamw.usable(opt, mains, grads, models)
        fused_adamw.step_(opt, mains, grads, models, grad_scale=scale, found_inf=found)
        for p, g in zip(ref_params, grads):
            p.grad = g.float()
        ref.grad_scale, ref.found_inf = scale, found
        ref.step()
        for mine, theirs, model in zip(mains, ref_params, models):
            torch.testing.assert_close(mine, theirs, rtol=RTOL, atol=ATOL)
            assert torch.equal(model, mine.to(torch.bfloat16))
        for mine, theirs in zip(mains, ref_params):
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.state[mine][key], ref.state[theirs][key], rtol=RTOL, atol=1e-12)
            assert opt.state[mine]["step"].item() == step + 1 and opt.state[mine]["step"].is_cuda


def test_found_inf_skips_update_and_step_count():
    mains, grads = _tensors(0, torch.bfloat16)
    opt = torch.optim.AdamW(mains, lr=1e-2, fused=True)
    fused_adamw.step_(opt, mains, grads, [None] * len(mains))
    before = [m.clone() for m in mains]
    fused_adamw.step_(opt, mains, grads, [None] * len(mains), found_inf=torch.ones((), device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(mains, before))
    assert all(opt.state[m]["step"].item() == 1 for m in mains)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_of_squares_equals_an_fp64_norm(dtype):
    _, grads = _tensors(4, dtype)
    got = kernel.sum_of_squares(grads)
    want = torch.cat([g.double() for g in grads]).square().sum()
    assert got.dtype == torch.float64 and got.is_cuda
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def _train(path: str, monkeypatch, micro_batches: int):
    """3 steps of a small bf16 MLP; path: "kernel" (lazy buffer + csrc AdamW: the CUDA default), "lazy"
    (lazy buffer + torch's fused AdamW on widened grads) or "buffer" (fp32 buffer up front + torch's)."""
    state.initialize()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(67, 4099), nn.GELU(), nn.Linear(4099, 31)).cuda().to(torch.bfloat16)
    with monkeypatch.context() as patch:
        if path == "buffer":
            patch.setattr(MixedPrecisionOptimizer, "_lazy_grad_buffer", lambda self: False)
        opt = MixedPrecisionOptimizer([model], lr=1e-2, weight_decay=0.1, clip_grad=0.5,
                                      precision_aware=path == "kernel")  # False: torch's fused AdamW
        gen = torch.Generator(device="cuda").manual_seed(1)
        norms = []
        for _ in range(3):
            opt.zero_grad()
            for _ in range(micro_batches):
                x = torch.randn(8, 67, generator=gen, device="cuda").to(torch.bfloat16)
                model(x).float().pow(2).mean().backward()
            updated, norm = opt.step()
            assert updated
            norms.append(norm)
    allocated = opt.grad_buffer.data is not None
    state.reset()
    models = [p.detach().clone() for p in opt.model_params]  # aligned with main_params (group order)
    return norms, models, [m.detach().clone() for m in opt.main_params], allocated


@pytest.mark.parametrize("path", ["kernel", "lazy"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_optimizer_paths_equal_the_fp32_buffer_and_torch_adamw(monkeypatch, path, micro_batches):
    """MixedPrecisionOptimizer with the lazy grad buffer (and, for "kernel", the csrc AdamW) vs the
    fp32 buffer allocated up front and torch's fused AdamW + cast: same norms (fp64, rtol 1e-12),
    main weights within 2 ulp, model weights equal to the main weights rounded."""
    norms_k, model_k, main_k, allocated = _train(path, monkeypatch, micro_batches)
    norms_t, model_t, main_t, _ = _train("buffer", monkeypatch, micro_batches)
    assert allocated == (micro_batches > 1)
    assert norms_k == pytest.approx(norms_t, rel=1e-12)
    for a, b in zip(main_k, main_t):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    for p, m in zip(model_k, main_k):
        assert torch.equal(p, m.to(p.dtype))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_kernel_with_bf16_moments_is_fp32_math_rounded(grad_dtype):
    """--exp-avg-dtype / --exp-avg-sq-dtype bf16: the kernel widens bf16 moments, steps in fp32 and rounds
    them back; the reference is torch's fused AdamW on fp32 moments that are rounded to bf16 after
    every step (1 bf16 ulp where a 2-ulp fp32 difference crosses a rounding boundary)."""
    mains, _ = _tensors(0, grad_dtype)
    ref_params = [m.detach().clone() for m in mains]
    ref = torch.optim.AdamW(ref_params, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    opt = torch.optim.AdamW(mains, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    for step in range(3):
        _, grads = _tensors(step + 1, grad_dtype)
        if step:  # the first step creates fp32 state; from then on it is kept in bf16
            for m in mains:
                for key in ("exp_avg", "exp_avg_sq"):
                    opt.state[m][key] = opt.state[m][key].to(torch.bfloat16)
            assert fused_adamw.usable(opt, mains, grads, [None] * len(mains))
        fused_adamw.step_(opt, mains, grads, [None] * len(mains))
        for p, g in zip(ref_params, grads):
            p.grad = g.float()
        ref.step()
        for p in ref_params:
            for key in ("exp_avg", "exp_avg_sq"):
                ref.state[p][key] = ref.state[p][key].to(torch.bfloat16).float()
        for mine, theirs in zip(mains, ref_params):
            torch.testing.assert_close(mine, theirs, rtol=RTOL, atol=ATOL)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.state[mine][key].float(), ref.state[theirs][key], rtol=2 ** -8, atol=1e-12)


def test_optimizer_creates_bf16_moments_in_the_kernel_and_matches_its_torch_path():
    """MixedPrecisionOptimizer with bf16 moments on CUDA: created in bf16 on the first step (no fp32
    moments ever) and stepped by the kernel, close to the same optimizer on torch's fused AdamW
    (precision_aware=False: fp32 moments widened from bf16 and rounded back) fed the same gradients.
    The two paths' fp32 moments may differ by 2 ulp, which can round a stored moment one bf16 ulp
    apart (2^-8 relative), moving later updates by a few 2^-8 of lr: atol lr / 32."""
    lr = 1e-2

    def run(precision_aware):
        state.initialize()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(67, 4099), nn.GELU(), nn.Linear(4099, 31)).to("cuda", torch.bfloat16)
        opt = MixedPrecisionOptimizer([model], lr=lr, weight_decay=0.1, clip_grad=0.0, precision_aware=precision_aware,
                                      moment_dtypes=(torch.bfloat16, torch.bfloat16))
        gen = torch.Generator(device="cuda").manual_seed(1)
        dtypes = []
        for _ in range(3):
            opt.zero_grad()
            # a backward whose gradients do not depend on the weights: the same on both paths
            fixed = [torch.randn(p.shape, generator=gen, device="cuda").mul(1e-2).bfloat16().float()
                     for p in model.parameters()]
            sum((p.float() * g).sum() for p, g in zip(model.parameters(), fixed)).backward()
            opt.step()
            dtypes.append({v.dtype for s in opt.optimizer.state.values() for k, v in s.items() if k != "step"})
        state.reset()
        return dtypes, [m.detach().clone() for m in opt.main_params], [p.detach().clone() for p in opt.model_params]

    dtypes, mains, weights = run(None)
    assert dtypes == [{torch.bfloat16}] * 3
    _, mains_torch, _ = run(False)
    for a, b in zip(mains, mains_torch):
        torch.testing.assert_close(a, b, rtol=0, atol=lr / 32)
    for w, m in zip(weights, mains):
        assert torch.equal(w, m.to(w.dtype))  # the model copy is the kernel's main weight rounded
