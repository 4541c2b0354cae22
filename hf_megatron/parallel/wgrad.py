"""Gradient accumulation fused into the weight-gradient GEMM (Megatron's `--gradient-accumulation-fusion`).

For a linear  Y = X W^T (+ b),  X [..., in] flattened to [T, in], dY [T, out], backward is

    dX = dY W            dW = dY^T X            db = sum_t dY_t

and the mixed-precision optimizer keeps  main_grad = sum over micro batches of dW  in fp32 (a view
of the contiguous grad buffer, parallel/grad_buffer.py).  Unfused, autograd writes dW as a bf16
`.grad` (one weight-sized allocation) and a hook adds it into main_grad (one fp32 read-modify-write
of the weight's size, per micro batch).  Fused, the GEMM accumulates into main_grad itself:

    main_grad <- main_grad + dY^T X          (one GEMM, beta = 1, fp32 output, bf16 inputs)

on CUDA `torch.addmm(main_grad, dY^T, X, out_dtype=float32, out=main_grad)` (aten::addmm.dtype_out,
checked once per device on a small case -- a torch whose kernel refuses an fp32 `self` with bf16
inputs falls back to the unfused `main_grad += dY^T X`); with equal dtypes (fp32 on CPU)
`main_grad.addmm_(dY^T, X)`; other CPU dtypes upcast to fp32 first.  Also more accurate: dW is
never rounded to bf16.

Readiness.  The grad buffer counts a weight as ready (overlap_grad_reduce) in its
post-accumulate-grad hook, which autograd only runs for a defined gradient.  So the fused backward
returns a *placeholder* dW: a fresh contiguous view of one scratch buffer per (device, dtype), as
large as the largest fused weight (allocated once, contents never read), so per call no
allocation, no fill, no kernel.  Autograd's AccumulateGrad steals it as `p.grad` (a fresh view
with the param's layout is taken as is, not copied), the hook fires, sees `is_placeholder(p.grad)`
(its storage is a scratch buffer, which no real gradient can share) and only counts readiness and
frees `p.grad`.  Megatron does the same with a `grad_added_to_main_grad` flag and a `torch.empty`
dummy gradient per call; here the test needs no flag set in backward, so it holds in compiled
graphs too, where backward runs no Python of ours but the op.

Compile.  The GEMM is the custom op `hf_megatron::accumulate_wgrad` (torch.library) with
`mutates_args=("main_grad",)` and main_grad an explicit input, and a fake implementation; dynamo
traces the autograd.Function around it, AOTAutograd puts the op in the backward graph and inductor
calls it in place on the buffer view (no copy, no graph break; tests/test_wgrad_fusion.py).

Scope (`apply_wgrad_fusion`, from outside, like TP): the linears of the transformer layers --
plain nn.Linear at tp = 1, ColumnParallelLinear / RowParallelLinear at tp > 1 (with sequence
parallelism X is the all-gathered input the column GEMM saw).  Not the output layer (tied to the
embedding, and a vocab-parallel loss of its own), not torchao's float8 linears.  A weight takes the
fused path only when it has a `main_grad` (the optimizer's grad buffer made one) and grad is
enabled; otherwise it is a plain F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# (device, dtype) -> scratch buffers; the last one is current, earlier (smaller) ones are kept
# alive so that no real gradient can ever be allocated at an address `is_placeholder` recognises
_SCRATCH: dict[tuple, list[torch.Tensor]] = {}
_LARGEST: dict[torch.dtype, int] = {}  # dtype -> numel of the largest fused weight: the scratch size
_DTYPE_GEMM: dict[torch.device, bool] = {}  # device -> addmm with out_dtype=fp32 works in place
_LAYER_PREFIX = "decoder.layers."


def _placeholder(weight: torch.Tensor) -> torch.Tensor:
    """A fresh view of weight's shape and dtype into the scratch buffer (contents undefined)."""
    buffers = _SCRATCH.setdefault((weight.device, weight.dtype), [])
    if not buffers or buffers[-1].numel() < weight.numel():
        numel = max(weight.numel(), _LARGEST.get(weight.dtype, 0))
        buffers.append(torch.empty(numel, dtype=weight.dtype, device=weight.device))
    return buffers[-1][:weight.numel()].view(weight.shape)


def is_placeholder(grad: torch.Tensor | None) -> bool:
    """True for the dW a fused backward returned (its real value is already in main_grad)."""
    if grad is None:
        return False
    ptr = grad.untyped_storage().data_ptr()
    return any(ptr == b.untyped_storage().data_ptr() for b in _SCRATCH.get((grad.device, grad.dtype), ()))


def fp32_accumulating_gemm(device: torch.device) -> bool:
    """Whether this torch's CUDA addmm accumulates bf16 x bf16 into an fp32 `self` in place (probed once)."""
    if device not in _DTYPE_GEMM:
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(24, 40, device=device, generator=gen).to(torch.bfloat16)
        b = torch.randn(40, 8, device=device, generator=gen).to(torch.bfloat16)
        acc = torch.randn(24, 8, device=device, generator=gen)
        expected = acc + a.float() @ b.float()
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _DTYPE_GEMM[device] = bool(torch.allclose(acc, expected, rtol=1e-3, atol=1e-3))
        except (RuntimeError, TypeError):
            _DTYPE_GEMM[device] = False
    return _DTYPE_GEMM[device]


@torch.library.custom_op("hf_megatron::accumulate_wgrad", mutates_args=("main_grad",))
def accumulate_wgrad(main_grad: torch.Tensor, input: torch.Tensor, grad_output: torch.Tensor,
                     weight: torch.Tensor) -> torch.Tensor:
    """main_grad += grad_output^T input (leading dims flattened); returns weight's placeholder dW."""
    x = input.reshape(-1, input.shape[-1])
    dy_t = grad_output.reshape(-1, grad_output.shape[-1]).t()
    if x.dtype == main_grad.dtype:
        main_grad.addmm_(dy_t, x)
    elif main_grad.is_cuda and fp32_accumulating_gemm(main_grad.device):
        torch.addmm(main_grad, dy_t, x, out_dtype=main_grad.dtype, out=main_grad)
    elif main_grad.is_cuda:  # an older kernel: the unfused numbers (bf16 product, fp32 sum)
        main_grad.add_(torch.mm(dy_t, x))
    else:
        main_grad.addmm_(dy_t.to(main_grad.dtype), x.to(main_grad.dtype))
    return _placeholder(weight)


@accumulate_wgrad.register_fake
def _(main_grad, input, grad_output, weight):
    return torch.empty_like(weight)


class _LinearWgradIntoMainGrad(torch.autograd.Function):
    """Y = X W^T + b whose backward accumulates dW into main_grad (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, main_grad):
        ctx.save_for_backward(x, weight)
        # not saved: main_grad is a view of the grad buffer, whose version counter every other
        # accumulation into the buffer bumps -- the saved-tensor check would refuse it
        ctx.main_grad = main_grad
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        (x, weight), main_grad = ctx.saved_tensors, ctx.main_grad
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_weight = accumulate_wgrad(main_grad, x, grad_output, weight)
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with dW accumulated straight into `weight.main_grad` when there is one and grad is on."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None or not (torch.is_grad_enabled() and weight.requires_grad):
        return F.linear(x, weight, bias)
    return _LinearWgradIntoMainGrad.apply(x, weight, bias, main_grad)


def _fused_forward(module: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x, module.weight, module.bias)
    forward.wgrad_fused = True
    return forward


def is_fused(module: nn.Module) -> bool:
    """Whether `module` is a linear whose weight gradient `apply_wgrad_fusion` fused."""
    return bool(getattr(module, "gradient_accumulation_fusion", False)
                or getattr(vars(module).get("forward"), "wgrad_fused", False))


def apply_wgrad_fusion(model: nn.Module) -> nn.Module:
    """Fuse the weight-gradient accumulation of every linear inside `model`'s transformer layers
    (in place; returns model).  Tensor-parallel linears switch their own flag; a plain nn.Linear
    gets the fused forward on the instance (parameter names unchanged).  Apply after `parallelize`
    and before `apply_compile`; applying twice is a no-op."""
    for name, module in model.named_modules():
        if not name.startswith(_LAYER_PREFIX) or is_fused(module):
            continue
        if hasattr(module, "gradient_accumulation_fusion"):  # Column/RowParallelLinear (parallel/layers.py)
            module.gradient_accumulation_fusion = True
        elif type(module) is nn.Linear:
            module.forward = _fused_forward(module)
        else:
            continue
        weight = module.weight  # shapes known already on the meta device: the scratch is sized once
        _LARGEST[weight.dtype] = max(_LARGEST.get(weight.dtype, 0), weight.numel())
    return model
