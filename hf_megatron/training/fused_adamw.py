"""The mixed-precision optimizer's AdamW calls, on a torch.optim.AdamW's state: torch's own fused
kernel called directly (`torch_step_`), or csrc/adamw.cu (`step_`: the default where it can run).

torch's fused AdamW needs gradients of the main weights' dtype (fp32), and casting the updated
main weights back into the bf16 model is a second pass over them.  The csrc kernel reads bf16
gradients as they are and writes the bf16 copy in the same pass, with torch's fused AdamW's
arithmetic.  The state stays torch's -- `optimizer.state[main]` = {step: 0-d fp32 on the device,
exp_avg, exp_avg_sq}, created here as torch's fused AdamW creates it on its first step -- so
checkpoints, `load_state_dict` and a later step by torch itself see no difference.

`step_` is used when every group is plain AdamW (no amsgrad, maximize, capturable or
differentiable; lr a number), fused (the state layout above) and every tensor is contiguous on one
CUDA device with the extension built (`usable`); `torch_step_` needs the same groups and grads of
the main weights' dtype; otherwise the caller runs `optimizer.step()`.
"""
from __future__ import annotations

import warnings

import torch

from ..kernels import adamw as kernel


def _plain(group: dict) -> bool:
    return (group.get("fused") and not group.get("amsgrad") and not group.get("maximize")
            and not group.get("capturable") and not group.get("differentiable")
            and group.get("decoupled_weight_decay", True) and not isinstance(group["lr"], torch.Tensor))


def plain_fused(optimizer) -> bool:
    """A torch.optim.AdamW(fused=True) of plain AdamW groups: its step is `torch._fused_adamw_` per group."""
    return isinstance(optimizer, torch.optim.AdamW) and all(_plain(g) for g in optimizer.param_groups)


def usable(optimizer, mains: list[torch.Tensor], grads: list[torch.Tensor], models: list,
           moment_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32)) -> bool:
    """Whether `step_` can run this optimizer's step in the csrc kernel: the moments (those to create,
    `moment_dtypes`, and those that exist) in one dtype it stores per tensor -- fp32, or bf16 with
    --exp-avg-dtype / --exp-avg-sq-dtype bf16."""
    if not (plain_fused(optimizer) and kernel.supported(mains, grads, [m for m in models if m is not None])):
        return False
    states = [s for s in (optimizer.state.get(m) for m in mains) if s and "exp_avg" in s]
    return kernel.moments_supported([moment_dtypes, *((s["exp_avg"].dtype, s["exp_avg_sq"].dtype) for s in states)])


_warned = False


def warn_unusable() -> None:
    """Once per process: --use-precision-aware-optimizer asked for the kernel, torch's AdamW steps."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn("--use-precision-aware-optimizer: csrc's AdamW needs CUDA tensors, the built extension "
                      "(hf_megatron/kernels/build.py) and plain fused AdamW groups; stepping with torch's AdamW",
                      RuntimeWarning, stacklevel=3)


def store_moments(optimizer, dtypes: tuple[torch.dtype, torch.dtype], dtype: torch.dtype | None = None) -> None:
    """Every AdamW moment of `optimizer` in `dtype` (default: `dtypes` = (exp_avg's, exp_avg_sq's), e.g.
    bf16 for --exp-avg-dtype bf16), rounded to nearest; moments already there are left alone."""
    for entry in optimizer.state.values():
        for key, default in zip(("exp_avg", "exp_avg_sq"), dtypes):
            want = dtype or default
            if key in entry and entry[key].dtype != want:
                entry[key] = entry[key].to(want)


def _state(optimizer, main: torch.Tensor, moment_dtypes=None) -> dict:
    state = optimizer.state[main]
    if not state:  # torch's fused AdamW's first-step state (moments in `moment_dtypes`, default main's)
        first, second = moment_dtypes or (main.dtype, main.dtype)
        state["step"] = torch.zeros((), dtype=torch.float32, device=main.device)
        state["exp_avg"] = torch.zeros_like(main, dtype=first, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(main, dtype=second, memory_format=torch.preserve_format)
    return state


def _each_group(optimizer, mains: list[torch.Tensor], found_inf: torch.Tensor | None, update,
                moment_dtypes=None) -> None:
    """Per param group as torch's fused AdamW steps it: its step counts += 1, then
    `update(members, states, steps, group)` (members: indices into mains), then the counts -=
    found_inf (a skipped step is not counted)."""
    index = {id(m): i for i, m in enumerate(mains)}
    for group in optimizer.param_groups:
        members = [index[id(p)] for p in group["params"]]
        if not members:
            continue
        states = [_state(optimizer, mains[i], moment_dtypes) for i in members]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        update(members, states, steps, group)
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))


def step_(optimizer, mains: list[torch.Tensor], grads: list[torch.Tensor], models: list,
          grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
          moment_dtypes: tuple[torch.dtype, torch.dtype] | None = None) -> None:
    """AdamW on `mains` (the optimizer's params, aligned with `grads`; `models[i]` the low-precision
    model tensor to overwrite with mains[i], or None) in the csrc kernel, where `usable` said so;
    moments created on the first step in `moment_dtypes` (default fp32)."""
    def update(members, states, steps, group):
        beta1, beta2 = group["betas"]
        kernel.adamw_([mains[i] for i in members], [grads[i] for i in members], [s["exp_avg"] for s in states],
                      [s["exp_avg_sq"] for s in states], [models[i] for i in members], steps,
                      lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                      weight_decay=group["weight_decay"], grad_scale=grad_scale, found_inf=found_inf)

    _each_group(optimizer, mains, found_inf, update, moment_dtypes)


def torch_step_(optimizer, mains: list[torch.Tensor], grads: list[torch.Tensor],
                grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> bool:
    """torch's own fused AdamW kernel on `mains` with `grads` (same dtype and device as their
    mains), called as `optimizer.step()` calls it -- steps += 1, `torch._fused_adamw_` per group,
    steps -= found_inf -- without setting and clearing every `.grad` and without the step's
    per-call grouping: the same numbers, less host time.  False (nothing done) where the
    optimizer is not `plain_fused` or a list does not fit one kernel call."""
    if not plain_fused(optimizer) or not mains:
        return False
    device, dtype = mains[0].device, mains[0].dtype
    if not all(m.device == device and m.dtype == dtype for m in mains) or not all(
            g.device == device and g.dtype == dtype for g in grads):
        return False
    def update(members, states, steps, group):
        beta1, beta2 = group["betas"]
        torch._fused_adamw_([mains[i] for i in members], [grads[i] for i in members], [s["exp_avg"] for s in states],
                            [s["exp_avg_sq"] for s in states], [], steps, amsgrad=False, lr=group["lr"],
                            beta1=float(beta1), beta2=float(beta2), weight_decay=group["weight_decay"],
                            eps=group["eps"], maximize=False, grad_scale=grad_scale, found_inf=found_inf)

    _each_group(optimizer, mains, found_inf, update)
    return True
