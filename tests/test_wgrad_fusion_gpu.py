"""--gradient-accumulation-fusion on CUDA in bf16 (skipped without a GPU; the lead runs it on an H200).

The fused GEMM accumulates bf16 x bf16 products into the fp32 main grad without rounding dW to
bf16, so against an fp64 reference it is *more* accurate than the unfused path (bf16 dW, then
added): fused within fp32 summation error, unfused within bf16 rounding, and the two within bf16
tolerance of each other -- on odd sizes (no multiple of 8 anywhere) and in a bf16 training step.
"""
import pytest
import torch
import torch.nn.functional as F

from test_wgrad_fusion import fresh_dynamo, recorded_run  # noqa: F401  (fixture: no compiled-graph reuse)
from tiny import rel_err
from training_helpers import make_batches

from hf_megatron.parallel import wgrad

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16_TOL = 1e-2  # a few bf16 ulps (2^-8) in norm


def test_in_place_fp32_accumulating_gemm_is_available():
    """torch >= 2.8's aten::addmm.dtype_out takes an fp32 `self` with bf16 operands; without it the
    fusion silently degrades to mm + add (still correct, not faster) -- this says which one runs."""
    assert wgrad.fp32_accumulating_gemm(torch.device("cuda")), f"torch {torch.__version__}: addmm(out_dtype=fp32) " \
        "refused an fp32 accumulator; the fused path falls back to mm + add"


@pytest.mark.parametrize("shape", [(3, 111, 257, 129), (1, 1000, 97, 1531), (2, 5, 8191, 33)])
def test_fused_bf16_wgrad_against_fp64_and_unfused(shape):
    batch, seq, in_features, out_features = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(seq, batch, in_features, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(out_features, in_features, device="cuda", generator=gen) / in_features ** 0.5).bfloat16()
    bias = torch.randn(out_features, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(seq, batch, out_features, device="cuda", generator=gen).bfloat16()
    earlier = torch.randn(out_features, in_features, device="cuda", generator=gen)  # earlier micro batches
    exact = earlier.double() + dy.reshape(-1, out_features).double().t() @ x.reshape(-1, in_features).double()

    plain_x, plain_w, plain_b = (t.clone().requires_grad_() for t in (x, weight, bias))
    F.linear(plain_x, plain_w, plain_b).backward(dy)
    unfused = earlier + plain_w.grad.float()  # what the grad buffer's hook adds today

    fused_x, fused_w, fused_b = (t.clone().requires_grad_() for t in (x, weight, bias))
    fused_w.main_grad = earlier.clone()
    out = wgrad.linear(fused_x, fused_w, fused_b)
    assert torch.equal(out, F.linear(x, weight, bias))
    out.backward(dy)
    assert wgrad.is_placeholder(fused_w.grad)
    assert rel_err(fused_w.main_grad.double(), exact) <= 1e-5
    assert rel_err(unfused.double(), exact) <= BF16_TOL
    assert rel_err(fused_w.main_grad, unfused) <= BF16_TOL
    assert rel_err(fused_x.grad.float(), plain_x.grad.float()) <= BF16_TOL
    assert rel_err(fused_b.grad.float(), plain_b.grad.float()) <= BF16_TOL


# odd MLP width (head dims stay multiples of 8 for the fused attention kernels)
ODD = {"llama": dict(hidden_size=96, intermediate_size=203, num_attention_heads=4, num_key_value_heads=2),
       "gpt2": dict(n_embd=96, n_head=4, n_inner=203)}


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_bf16_training_fused_vs_unfused_main_grads(arch, compile):
    keep_alive, batches = [], make_batches(2)
    runs = [recorded_run(arch, {}, batches, fusion, keep_alive, compile=compile, device="cuda",
                         hf_overrides=ODD[arch], bf16=True) for fusion in (True, False)]
    fused, plain = runs
    assert fused["fused_modules"] > 0 and plain["fused_modules"] == 0
    for ours, ref in zip(fused["losses"], plain["losses"]):
        assert abs(ours - ref) <= BF16_TOL * abs(ref)
    for name, grad in plain["grads"][0].items():  # the first step: same weights on both sides
        assert rel_err(fused["grads"][0][name], grad) <= BF16_TOL, name
