"""Python side of csrc/adamw.cu: AdamW over lists of fp32 main weights whose gradients may be
bf16/fp16, and the fp64 sum of squares of a tensor list.

Both kernels take a table of tensor addresses (one int64 row per tensor: main, grad, exp_avg,
exp_avg_sq, model copy, step, numel), copied to the device with each launch because gradients
move between steps, and a block list (tensor, chunk of `CHUNK` elements) that depends only on the
sizes and is kept.  `adamw_` is the update of torch's fused AdamW: the kernel reads each tensor's
step count, which the caller has already incremented (and decrements by `found_inf` after, as
torch does: training/fused_adamw.py), and skips everything when `found_inf` is 1.  `adamw_` has
no fallback here: `supported` says whether a list can go to the kernel, and the caller keeps
torch's AdamW for the rest.
"""
from __future__ import annotations

import torch

from .build import load_extension

CHUNK = 65536  # csrc/adamw.cu kChunk
_BLOCKS: dict[tuple, torch.Tensor] = {}  # (device, numels) -> int32 [blocks, 2]
_TABLES: dict[tuple, torch.Tensor] = {}  # (device, rows) -> int64 [n, 7]: the last few tables, by content
_TABLES_KEPT = 8


MOMENT_DTYPES = (torch.float32, torch.bfloat16)  # csrc/adamw.cu's moment storage types


def moments_supported(dtype_pairs) -> bool:
    """Each (exp_avg dtype, exp_avg_sq dtype) pair one dtype the kernel stores (float32 or bfloat16)."""
    return all(first == second and first in MOMENT_DTYPES for first, second in dtype_pairs)


def supported(*tensor_lists) -> bool:
    """Every tensor on one CUDA device, contiguous, and the extension built."""
    tensors = [t for tensors in tensor_lists for t in tensors if t is not None]
    if not tensors or not tensors[0].is_cuda:
        return False
    device = tensors[0].device
    if not all(t.device == device and t.is_contiguous() for t in tensors):
        return False
    return load_extension() is not None


def _blocks(device: torch.device, numels: tuple[int, ...]) -> torch.Tensor:
    key = (device, numels)
    blocks = _BLOCKS.get(key)
    if blocks is None:
        pairs = [(i, c) for i, n in enumerate(numels) for c in range(-(-n // CHUNK))]
        blocks = torch.tensor(pairs, dtype=torch.int32).to(device)
        _BLOCKS[key] = blocks
    return blocks


def _table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """The rows as a device tensor.  A step's tables repeat from step to step (the same parameters at
    the same addresses), so the last few are kept by content: a repeated table costs no pinned
    allocation and no copy, host time that would otherwise delay the step's first optimizer kernel."""
    key = (device, tuple(map(tuple, rows)))
    table = _TABLES.pop(key, None)
    if table is None:
        host = torch.tensor(rows, dtype=torch.int64)
        table = host.pin_memory().to(device, non_blocking=True) if torch.cuda.is_available() else host.to(device)
        while len(_TABLES) >= _TABLES_KEPT:
            del _TABLES[next(iter(_TABLES))]  # the least recently used
    _TABLES[key] = table  # most recent last
    return table


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def sum_of_squares(tensors: list[torch.Tensor], kernel: bool = True) -> torch.Tensor:
    """sum_i sum_j double(t_i[j])^2 as an fp64 0-d tensor on the tensors' device (no host sync), by
    the csrc kernel where `kernel` and `supported`, else from torch's fp64 per-tensor norms."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    device = tensors[0].device
    if not (kernel and supported(tensors)):
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)).square().sum()
    ext, total = load_extension(), torch.zeros((), dtype=torch.float64, device=device)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [t for t in tensors if t.dtype == dtype]
        table = _table([[0, t.data_ptr(), 0, 0, 0, 0, t.numel()] for t in same], device)
        partial = ext.multi_tensor_sum_of_squares(table, _blocks(device, tuple(t.numel() for t in same)), same[0])
        total = total + partial.sum()
    return total


@torch.no_grad()
def adamw_(mains, grads, exp_avgs, exp_avg_sqs, models, steps, *, lr: float, beta1: float, beta2: float,
           eps: float, weight_decay: float, grad_scale: torch.Tensor | None = None,
           found_inf: torch.Tensor | None = None) -> None:
    """One AdamW step of every main weight (fp32) with its gradient (any float dtype), moments (fp32 or
    bf16, `moments_supported`) and 0-d fp32 step count (already incremented for this step), writing the updated weight into
    `models[i]` too where it is not None (see csrc/adamw.cu for the formula).  Call only where
    `supported(...)` holds."""
    if not mains:
        return
    ext, device = load_extension(), mains[0].device
    kinds: dict[tuple, list[int]] = {}
    for i, (g, model) in enumerate(zip(grads, models)):
        kinds.setdefault((g.dtype, None if model is None else model.dtype, exp_avgs[i].dtype), []).append(i)
    for (grad_dtype, model_dtype, _), members in kinds.items():
        members = [i for i in members if mains[i].numel()]
        if not members:
            continue
        rows = [[mains[i].data_ptr(), grads[i].data_ptr(), exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(),
                 _ptr(models[i]), steps[i].data_ptr(), mains[i].numel()] for i in members]
        blocks = _blocks(device, tuple(mains[i].numel() for i in members))
        model_like = None if model_dtype is None else models[members[0]]
        ext.multi_tensor_adamw(_table(rows, device), blocks, grads[members[0]], model_like, exp_avgs[members[0]],
                               float(lr), float(beta1),
                               float(beta2), float(eps), float(weight_decay), grad_scale, found_inf)
