"""The csrc SwiGLU kernels as torch.library custom ops, so torch.compile keeps them.

Inside a compiled region the autograd Functions of functions.py would graph-break, so the
compiled layers used to trace the PyTorch expression instead.  For SwiGLU that loses: inductor
lowers the backward's `cat([d gate, d up])` to one kernel that, for every output element, loads
the inputs of both halves (twice the reads of the csrc kernel, which writes both halves from one
load of gate, up and dy).  As custom ops with fake (shape-only) implementations the kernels are
opaque nodes in the graph: no break, no re-lowering.

    hf_megatron::swiglu(x [..., 2F]) -> [..., F]                 silu(gate) * up
    hf_megatron::swiglu_backward(dy [..., F], x [..., 2F]) -> dx   [d gate; d up]

CUDA tensors run the extension; any other device runs the PyTorch expression (forward) and the
steps autograd takes through it (backward), so the ops are defined, checkable and compilable everywhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .build import load_extension
from .reference import swiglu_reference


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


@torch.library.custom_op("hf_megatron::swiglu", mutates_args=())
def swiglu(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return load_extension().swiglu_forward(_rows(x)).view(*x.shape[:-1], x.shape[-1] // 2)
    return swiglu_reference(x).clone()  # an op's output may not alias its input


@swiglu.register_fake
def _swiglu_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@torch.library.custom_op("hf_megatron::swiglu_backward", mutates_args=())
def swiglu_backward(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return load_extension().swiglu_backward(_rows(dy), _rows(x)).view(x.shape)
    gate, up = x.chunk(2, dim=-1)  # autograd's own steps for silu(gate) * up, op for op
    return torch.cat((torch.ops.aten.silu_backward(dy * up, gate), dy * F.silu(gate)), dim=-1)


@swiglu_backward.register_fake
def _swiglu_backward_fake(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx, dy: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return swiglu_backward(dy, x)


swiglu.register_autograd(_backward, setup_context=_setup)
