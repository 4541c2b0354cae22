"""The SwiGLU custom ops (kernels/ops.py): registered correctly (torch.library.opcheck: schema,
fake implementation, autograd registration), equal to the PyTorch expression and its autograd
gradient, and traced by torch.compile as one opaque node without a graph break.  On CPU the ops
run their non-CUDA branch; tests/test_kernels_gpu.py checks the CUDA kernels themselves."""
import pytest
import torch

from hf_megatron.kernels import ops, reference


def _x(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def test_swiglu_ops_pass_opcheck():
    torch.library.opcheck(torch.ops.hf_megatron.swiglu.default, (_x(3, 5, 2 * 7),))
    torch.library.opcheck(torch.ops.hf_megatron.swiglu_backward.default,
                          (torch.randn(3, 5, 7, dtype=torch.float64), torch.randn(3, 5, 14, dtype=torch.float64)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_swiglu_op_equals_expression_and_its_gradient(dtype):
    x = _x(4, 3, 2 * 9, dtype=dtype, seed=1)
    probe = torch.randn(4, 3, 9, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = ops.swiglu(x)
    (dx,) = torch.autograd.grad((y * probe).sum(), x)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = reference.swiglu_reference(x_ref)
    (dx_ref,) = torch.autograd.grad((y_ref * probe).sum(), x_ref)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert torch.autograd.gradcheck(ops.swiglu, (_x(2, 2 * 4, seed=3),)) if dtype == torch.float64 else True


def test_swiglu_op_compiles_without_graph_break():
    def mlp(x, w1, w2):
        return ops.swiglu(x @ w1) @ w2

    x, w1, w2 = _x(6, 8, dtype=torch.float32, seed=4), _x(8, 2 * 5, dtype=torch.float32, seed=5), \
        _x(5, 8, dtype=torch.float32, seed=6)
    explanation = torch._dynamo.explain(mlp)(x, w1, w2)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=True)
    out = compiled(x, w1, w2)
    grads = torch.autograd.grad(out.sum(), (x, w1, w2))
    ref_out = mlp(x, w1, w2)
    ref_grads = torch.autograd.grad(ref_out.sum(), (x, w1, w2))
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
