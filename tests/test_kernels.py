"""hf_megatron.kernels on CPU: the fallbacks against transformers' own modules (values and grads),
the backward formulas the CUDA kernels implement against autograd (float64), gradcheck, and the
dispatcher's switches (env var, warn-once on a failed build).  GPU tests: test_kernels_gpu.py."""
import re
import warnings
from pathlib import Path

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from hf_megatron import kernels
from hf_megatron.kernels import build, functions

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _randn(*shape, dtype=torch.float32, seed=0, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).requires_grad_(requires_grad)


def _value_and_grads(fn, inputs, seed=7):
    """fn(*inputs), then grads of sum(out * random) w.r.t. every input that requires grad."""
    out = fn(*inputs)
    probe = _randn(*out.shape, dtype=out.dtype, seed=seed, requires_grad=False)
    grads = torch.autograd.grad((out * probe).sum(), [t for t in inputs if isinstance(t, torch.Tensor)
                                                      and t.requires_grad])
    return out, grads


def _assert_same(ours, ref):
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    assert torch.equal(ours, ref), (ours.double() - ref.double()).abs().max()


# ---- fallbacks == transformers (bitwise: the same ops in the same order) ----

@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_transformers_llama_rmsnorm(dtype):
    hidden, eps = 48, 1e-5
    hf = LlamaRMSNorm(hidden, eps=eps).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(_randn(hidden, seed=1, requires_grad=False))
    weight = hf.weight.detach().clone().requires_grad_(True)
    x = _randn(2, 5, hidden, dtype=dtype, seed=2)

    ours, (dx, dw) = _value_and_grads(lambda x_, w_: kernels.rms_norm(x_, w_, eps), (x, weight))
    ref, (ref_dx, ref_dw) = _value_and_grads(lambda x_, w_: torch.func.functional_call(hf, {"weight": w_}, (x_,)),
                                             (x, hf.weight))
    for a, b in ((ours, ref), (dx, ref_dx), (dw, ref_dw)):
        _assert_same(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_transformers_silu_times_up(dtype):
    x = _randn(3, 2, 2 * 40, dtype=dtype, seed=3)
    ours, (dx,) = _value_and_grads(kernels.swiglu, (x,))
    ref, (ref_dx,) = _value_and_grads(lambda t: ACT2FN["silu"](t[..., :40]) * t[..., 40:], (x,))
    _assert_same(ours, ref)
    _assert_same(dx, ref_dx)


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rotary_matches_transformers_apply_rotary_pos_emb(dtype):
    b, heads, s, d = 2, 3, 7, 16
    q = _randn(b, heads, s, d, dtype=dtype, seed=4)
    angles = torch.arange(s)[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    emb = torch.cat((angles, angles), -1)[None].expand(b, s, d)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    ours, (dq,) = _value_and_grads(lambda t: kernels.apply_rotary(t, cos, sin), (q,))
    ref, (ref_dq,) = _value_and_grads(lambda t: apply_rotary_pos_emb(t, t, cos, sin)[0], (q,))
    _assert_same(ours, ref)
    _assert_same(dq, ref_dq)


# ---- the closed-form backward each CUDA kernel computes == autograd (float64) ----

def test_rms_norm_backward_formula_matches_autograd():
    """dx = r * (g - x_hat * mean(g * x_hat)), g = dy * w;  dw = sum_rows dy * x_hat.

    Autograd runs on the formula in float64 throughout (the fallback itself keeps fp32 statistics,
    as transformers does, so it is only fp32-accurate: see the gradcheck below)."""
    eps = 1e-6
    x, w = _randn(6, 32, dtype=torch.float64, seed=5), _randn(32, dtype=torch.float64, seed=6)
    y, (dx, dw) = _value_and_grads(lambda a, b: b * (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps)),
                                   (x, w), seed=8)
    dy = _randn(*y.shape, dtype=torch.float64, seed=8, requires_grad=False)
    x = x.detach()
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x_hat, g = x * r, dy * w.detach()
    torch.testing.assert_close(dx, r * (g - x_hat * (g * x_hat).mean(-1, keepdim=True)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, (dy * x_hat).sum(0), rtol=1e-12, atol=1e-12)


def test_swiglu_backward_formula_matches_autograd():
    """d_gate = dy * up * s * (1 + gate * (1 - s)), s = sigmoid(gate);  d_up = dy * silu(gate)."""
    x = _randn(5, 2 * 12, dtype=torch.float64, seed=9)
    y, (dx,) = _value_and_grads(kernels.swiglu, (x,), seed=10)
    dy = _randn(*y.shape, dtype=torch.float64, seed=10, requires_grad=False)
    gate, up = x.detach().chunk(2, -1)
    s = torch.sigmoid(gate)
    expected = torch.cat((dy * up * s * (1 + gate * (1 - s)), dy * gate * s), -1)
    torch.testing.assert_close(dx, expected, rtol=1e-12, atol=1e-12)


def test_rotary_backward_formula_matches_autograd():
    """dx = dy * cos - rotate_half(dy * sin)  (rotate_half is antisymmetric)."""
    x = _randn(2, 3, 5, 8, dtype=torch.float64, seed=11)
    cos, sin = (_randn(2, 5, 8, dtype=torch.float64, seed=s, requires_grad=False) for s in (12, 13))
    y, (dx,) = _value_and_grads(lambda t: kernels.apply_rotary(t, cos, sin), (x,), seed=14)
    dy = _randn(*y.shape, dtype=torch.float64, seed=14, requires_grad=False)
    expected = dy * cos[:, None] - kernels.rotate_half(dy * sin[:, None])
    torch.testing.assert_close(dx, expected, rtol=1e-12, atol=1e-12)


def test_gradcheck_fallbacks_float64():
    x, w = _randn(3, 6, dtype=torch.float64, seed=15), _randn(6, dtype=torch.float64, seed=16)
    # rms_norm computes its statistics in fp32 by design (x.float()), so finite differences see
    # fp32 rounding: a larger step and fp32-level tolerances
    assert torch.autograd.gradcheck(lambda a, b: kernels.rms_norm(a, b, 1e-6), (x, w), eps=1e-3, atol=1e-4,
                                    rtol=1e-3)
    assert torch.autograd.gradcheck(kernels.swiglu, (_randn(3, 8, dtype=torch.float64, seed=17),))
    cos, sin = (_randn(1, 4, 6, dtype=torch.float64, seed=s) for s in (18, 19))  # batch-broadcast tables
    q = _randn(2, 2, 4, 6, dtype=torch.float64, seed=20)
    assert torch.autograd.gradcheck(kernels.apply_rotary, (q, cos, sin))  # cos/sin grads: fallback path


# ---- dispatcher ----

def test_swiglu_rejects_odd_last_dim():
    with pytest.raises(ValueError, match="last dim must be even"):
        kernels.swiglu(torch.zeros(2, 5))


def test_env_switch_disables_kernels(monkeypatch):
    monkeypatch.setenv("HF_MEGATRON_KERNELS", "0")
    assert not kernels.enabled() and not kernels.kernels_available()
    monkeypatch.setenv("HF_MEGATRON_KERNELS", "1")
    assert kernels.enabled()


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    def broken_build():
        raise RuntimeError("Error building extension 'hf_megatron_kernels'\nninja: build stopped")

    monkeypatch.setattr(build, "_build", broken_build)
    build.reset_for_tests()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert build.load_extension() is None
            assert build.load_extension() is None
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == 1
        assert "using PyTorch fallbacks" in messages[0] and "Error building extension" in messages[0]
        assert "ninja: build stopped" not in messages[0]  # one line, not the whole log
    finally:
        build.reset_for_tests()


def test_build_directory_honours_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build.build_directory().parent == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert build.build_directory().parent == Path.home() / ".cache" / "hf_megatron"
    assert torch.__version__.split("+")[0] in build.build_directory().name


def test_bindings_export_every_entry_point_the_python_side_calls():
    """functions.py calls ext.<name>(...); each name must be m.def'd in csrc/bindings.cpp and defined in a .cu."""
    called = set(re.findall(r"load_extension\(\)\.(\w+)\(", Path(functions.__file__).read_text()))
    bound = set(re.findall(r'm\.def\("(\w+)"', (build.CSRC / "bindings.cpp").read_text()))
    cuda_text = "".join(p.read_text() for p in build.CSRC.glob("*.cu"))
    assert called and called <= bound
    for name in bound:
        assert re.search(rf"\b{name}\(const at::Tensor", cuda_text), name


# ---- the autograd Functions, on CPU, over a stand-in extension that checks the C++ contract ----

class ContractExtension:
    """The csrc/ entry points re-written in PyTorch (closed-form backward), asserting each input
    the way the C++ TORCH_CHECKs do, so functions.py's reshapes, saved tensors and gradient
    plumbing run on CPU.  It never calls the reference functions it is compared against."""

    @staticmethod
    def _rows(t, cols=None):
        assert t.dim() == 2 and t.is_contiguous() and (cols is None or t.shape[1] == cols)
        return t

    def rms_norm_forward(self, x, weight, eps):
        self._rows(x, weight.shape[0])
        assert weight.is_contiguous() and weight.dtype == x.dtype and isinstance(eps, float)
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1) + eps)
        return [(weight.float() * (x32 * rstd[:, None]).to(x.dtype).float()).to(x.dtype), rstd]

    def rms_norm_backward(self, dy, x, weight, rstd):
        self._rows(dy, x.shape[1]), self._rows(x)
        assert rstd.dtype == torch.float32 and rstd.shape == (x.shape[0],)
        x_hat, g = x.float() * rstd[:, None], dy.float() * weight.float()
        dx = rstd[:, None] * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        return [dx.to(x.dtype), (dy.float() * x_hat.to(x.dtype).float()).sum(0).to(weight.dtype)]

    def swiglu_forward(self, x):
        gate, up = self._rows(x).float().chunk(2, -1)
        return (gate * torch.sigmoid(gate) * up).to(x.dtype)

    def swiglu_backward(self, dy, x):
        self._rows(dy, x.shape[1] // 2)
        gate, up = self._rows(x).float().chunk(2, -1)
        s, dy = torch.sigmoid(gate), dy.float()
        return torch.cat((dy * up * s * (1 + gate * (1 - s)), dy * gate * s), -1).to(x.dtype)

    @staticmethod
    def _rotary(x, cos, sin, sign):
        assert x.dim() == 4 and x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
        half = x.shape[-1] // 2
        c, s, v = cos[:, None].float(), sin[:, None].float(), x.float()
        v1, v2 = v[..., :half], v[..., half:]
        if sign > 0:  # forward: y = x cos + rotate_half(x) sin
            out = torch.cat((v1 * c[..., :half] - v2 * s[..., :half], v2 * c[..., half:] + v1 * s[..., half:]), -1)
        else:  # backward: dx = g cos - rotate_half(g sin)
            out = torch.cat((v1 * c[..., :half] + v2 * s[..., half:], v2 * c[..., half:] - v1 * s[..., :half]), -1)
        return out.to(x.dtype).contiguous()

    def rotary_forward(self, x, cos, sin):
        return self._rotary(x, cos, sin, +1)

    def rotary_backward(self, dy, cos, sin):
        return self._rotary(dy, cos, sin, -1)


def test_autograd_functions_over_the_extension_contract(monkeypatch):
    monkeypatch.setattr(functions, "load_extension", ContractExtension)
    f64 = torch.float64
    x, w = _randn(2, 3, 16, dtype=f64, seed=21), _randn(16, dtype=f64, seed=22)
    x_t = x.detach().transpose(0, 1).requires_grad_()  # not contiguous: the Function must copy
    fused = _value_and_grads(lambda a, b: functions.FusedRMSNorm.apply(a, b, 1e-6), (x_t, w))
    ref = _value_and_grads(lambda a, b: kernels.rms_norm(a, b, 1e-6), (x_t, w))
    for a, b in zip((fused[0], *fused[1]), (ref[0], *ref[1])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # fp32 statistics in both

    qkv = _randn(5, 2, 3, 3, 8, dtype=f64, seed=24, requires_grad=False)
    q = qkv[:, :, :, 0].permute(1, 2, 0, 3).requires_grad_()  # [b=2, heads=3, s=5, d=8], strided like attention
    for batch in (2, 1):  # per-sample and batch-broadcast tables
        cos, sin = (_randn(batch, 5, 8, dtype=f64, seed=s, requires_grad=False) for s in (25, 26))
        fused = _value_and_grads(lambda t: functions.FusedRotary.apply(t, cos, sin), (q,))
        ref = _value_and_grads(lambda t: kernels.apply_rotary(t, cos, sin), (q,))
        torch.testing.assert_close(fused[0], ref[0]), torch.testing.assert_close(fused[1][0], ref[1][0])
