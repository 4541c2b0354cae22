"""CUDA kernels vs the PyTorch fallbacks (GPU only; skipped without CUDA).

Each test runs an op twice on the same CUDA inputs: through the kernel and through
hf_megatron.kernels.reference (the exact eager expressions), forward and backward.
Tolerances:
  float32: relative (norm-wise) error <= 1e-5 for every output and gradient;
  bf16 / fp16, elementwise ops (SwiGLU, rotary): the kernel rounds where eager rounds, so values
      and grads must agree to 1 ulp (rtol 2^-7 bf16, 2^-10 fp16);
  bf16 / fp16, RMSNorm: y within 2 ulp (the fp32 statistics may differ in their last
      bit, then up to two roundings follow); dx, dw norm-wise <= 1e-2 (bf16) / 2e-3 (fp16), and
      the kernel's error against a float64 evaluation is no worse than 1.25x the fallback's (the
      RMSNorm kernel keeps dy * w in fp32 where eager rounds it).
"""
import pytest
import torch

from hf_megatron import kernels
from hf_megatron.kernels import reference
from tiny import VOCAB, local_grads, rel_err, tiny_hf_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 1e-6}
NORM_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def extension():
    ext = kernels.load_extension()
    assert ext is not None, "the CUDA extension failed to build (see the warning above)"
    return ext


def _rand(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


def _run(fn, inputs, probe):
    """Output and grads of sum(fn(*inputs) * probe) for the inputs that require grad."""
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]  # same storage and strides
    out = fn(*leaves)
    grads = torch.autograd.grad((out * probe).sum(), [t for t in leaves if t.requires_grad])
    return out.detach(), grads


def _assert_ulp_close(a, b, dtype, ulps=1):
    """Within `ulps` units in the last place, relative; absolute slack for values near zero."""
    atol = 1e-6 if dtype == torch.float32 else ULP[dtype] * 1e-2
    torch.testing.assert_close(a, b, rtol=ulps * ULP[dtype], atol=ulps * atol)


def _uses_kernel(monkeypatch, fused_name):
    """Count calls of the fused Function (or, for SwiGLU, the custom op) so a test fails if the
    dispatcher silently fell back."""
    from hf_megatron.kernels import functions, ops
    calls = []
    if fused_name == "swiglu":
        original = ops.swiglu
        monkeypatch.setattr(ops, "swiglu", lambda *a: calls.append(1) or original(*a))
        return calls
    original = getattr(functions, fused_name).apply
    monkeypatch.setattr(getattr(functions, fused_name), "apply", lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 999), (2, 3, 4096), (8192, 1024), (5, 16384), (3, 65536)])
def test_rms_norm_kernel_matches_fallback(monkeypatch, dtype, shape):
    """999: unvectorised path; 16384: shared-memory opt-in; 65536: weight-grad partials in global
    memory; 8192 rows: many rows per backward block."""
    calls = _uses_kernel(monkeypatch, "FusedRMSNorm")
    eps = 1e-5
    x = (_rand(*shape, dtype=dtype, seed=1, scale=3.0) + 0.5).requires_grad_()
    w = (1 + 0.1 * _rand(shape[-1], dtype=torch.float32, seed=2)).to(dtype).requires_grad_()
    inputs = (x, w)
    probe = _rand(*shape, dtype=dtype, seed=4)
    y, grads = _run(lambda *t: kernels.rms_norm(*t, eps), inputs, probe)
    ref_y, ref_grads = _run(lambda *t: reference.rms_norm_reference(*t, eps), inputs, probe)
    assert calls, "the kernel was not used"
    assert y.dtype == dtype and all(g.dtype == dtype for g in grads)
    _assert_ulp_close(y, ref_y, dtype, ulps=2)  # statistics may differ in their last bit: two roundings follow
    for ours, eager_grad in zip(grads, ref_grads):
        assert rel_err(ours, eager_grad) <= NORM_TOL[dtype]
    if dtype != torch.float32:  # no less accurate than eager against a float64 evaluation
        _, exact_grads = _run(lambda *t: reference.rms_norm_reference(*t, eps), [t.double() for t in inputs],
                              probe.double())
        for ours, eager_grad, exact in zip(grads, ref_grads, exact_grads):
            assert rel_err(ours, exact) <= 1.25 * rel_err(eager_grad, exact) + 1e-6


def test_rms_norm_weight_grad_is_deterministic():
    x = _rand(4096, 2048, dtype=torch.bfloat16, seed=4).requires_grad_()
    w = torch.ones(2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probe = _rand(4096, 2048, dtype=torch.bfloat16, seed=5)
    first = _run(lambda a, b: kernels.rms_norm(a, b, 1e-6), (x, w), probe)[1]
    second = _run(lambda a, b: kernels.rms_norm(a, b, 1e-6), (x, w), probe)[1]
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 2, 2 * 1792), (5, 2 * 7), (3, 2 * 64)])
def test_swiglu_kernel_matches_fallback(monkeypatch, dtype, shape):
    calls = _uses_kernel(monkeypatch, "swiglu")
    x = _rand(*shape, dtype=dtype, seed=6, scale=2.0).requires_grad_()
    probe = _rand(*shape[:-1], shape[-1] // 2, dtype=dtype, seed=7)
    y, (dx,) = _run(kernels.swiglu, (x,), probe)
    ref_y, (ref_dx,) = _run(reference.swiglu_reference, (x,), probe)
    assert calls, "the kernel was not used"
    _assert_ulp_close(y, ref_y, dtype)
    _assert_ulp_close(dx, ref_dx, dtype)
    assert rel_err(y, ref_y) <= NORM_TOL[dtype] and rel_err(dx, ref_dx) <= NORM_TOL[dtype]


def _rotary_tables(batch, seq, dim, dtype):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    pos = torch.arange(seq, device="cuda").float()[None, :, None] + torch.arange(batch, device="cuda")[:, None, None]
    emb = torch.cat((pos * inv_freq, pos * inv_freq), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "qkv_view", "broadcast_batch", "odd_dim"])
def test_rotary_kernel_matches_fallback(monkeypatch, dtype, layout):
    calls = _uses_kernel(monkeypatch, "FusedRotary")
    b, heads, s, d = 2, 4, 33, 128
    if layout == "odd_dim":
        d = 6  # d/2 = 3: unvectorised path
    if layout == "qkv_view":  # as attention.py's k: a strided view of the fused qkv output
        qkv = _rand(s, b, heads, 3, d, dtype=dtype, seed=8)
        x = qkv[:, :, :, 1].permute(1, 2, 0, 3)  # [b, heads, s, d], not contiguous
        assert not x.is_contiguous()
    else:
        x = _rand(b, heads, s, d, dtype=dtype, seed=8)
    cos, sin = _rotary_tables(1 if layout == "broadcast_batch" else b, s, d, dtype)
    x.requires_grad_()
    probe = _rand(b, heads, s, d, dtype=dtype, seed=9)
    y, (dx,) = _run(lambda t: kernels.apply_rotary(t, cos, sin), (x,), probe)
    ref_y, (ref_dx,) = _run(lambda t: reference.apply_rotary_reference(t, cos, sin), (x,), probe)
    assert calls, "the kernel was not used"
    _assert_ulp_close(y, ref_y, dtype)
    _assert_ulp_close(dx, ref_dx, dtype)


def test_rotary_with_cos_grad_falls_back():
    x = _rand(1, 2, 4, 8, dtype=torch.float32, seed=10)
    cos, sin = _rotary_tables(1, 4, 8, torch.float32)
    cos.requires_grad_()
    y = kernels.apply_rotary(x, cos, sin)
    y.sum().backward()
    assert cos.grad is not None


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_model_with_kernels_matches_fallbacks(monkeypatch, arch, dtype, tol):
    """Tiny Llama (RMSNorm, SwiGLU, rotary) and GPT-2 (no fused op: its LayerNorm stays PyTorch's) on CUDA: logits and every
    parameter gradient, kernels on vs HF_MEGATRON_KERNELS=0."""
    import hf_megatron

    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1)).cuda()
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv("HF_MEGATRON_KERNELS", switch)
        model = hf_megatron.from_pretrained(tiny_hf_model(arch)).to(device="cuda", dtype=dtype)
        out = model(ids, labels=ids)
        out.loss.backward()
        results.append((out.logits.float(), local_grads(model)))
    (logits, grads), (ref_logits, ref_grads) = results
    assert rel_err(logits, ref_logits) <= tol
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        assert rel_err(grads[name], ref_grads[name]) <= tol, name
