"""Megatron-LM's optimizer entry of model_optim_rng.pt (megatron-core 0.16.1), written and read.

What megatron-core's optimizer classes put there (`state_dict()`), and what we write for the same run:

* fp32 model -- `FP32Optimizer`: the inner torch optimizer's own state dict, not nested:

      {"state": {k: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [group, ...]}

* bf16 / fp16 model -- `Float16OptimizerWithFloat16Params`:

      {"optimizer": {"state": ..., "param_groups": ...},
       "grad_scaler": {"scale": fp32 [1], "growth_tracker": int, "hysteresis_tracker": int},
       "fp32_from_fp16_params": [[fp32 main weight of each bf16/fp16 param of group g], ...]}

  `grad_scaler` is {} for a constant --loss-scale and absent for bf16 without one (no scaler).

State index k and the per-group lists follow megatron-core's `_get_param_groups`: groups in the order
(wd_mult 1, then wd_mult 0 -- 1-D params and biases), each listing its params in the order
`model_chunk.named_parameters()` yields them over the chunks, numbered consecutively over the groups
(torch's `Optimizer.state_dict`).  Every group carries the fields megatron-core matches groups by on
load (`param_group_identifier_keys`: wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) and the
ones its scheduler reads (max_lr, min_lr, default_config), plus `step` (what apex / TE FusedAdam keep
per group, so a GPU run with those resumes the bias correction too).

Param order.  Our GPTModel registers a layer's modules as megatron-core's local-spec layer does except
in attention: megatron-core's `Attention.__init__` registers `linear_proj` before `SelfAttention`
registers `linear_qkv` (and q/k layernorms), so there `linear_proj` comes first.  `megatron_groups`
applies exactly that move (tests/test_megatron_optimizer.py checks the result name by name against a
megatron-core GPTModel's `named_parameters`).  Our own optimizer keeps its order (the grad buffer and
distrib_optim.pt follow it); the permutation is applied only here, at the checkpoint boundary.
"""
from __future__ import annotations

import torch

from ..errors import CheckpointError

IDENTIFIER_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")  # megatron-core's group key
# how torch runs the step on this machine: ours, never the checkpoint's (a CUDA run's `fused` on a CPU one)
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")


def group_fields(no_decay: bool) -> dict:
    """megatron-core's fields of a default param group (`_get_param_groups`, no overrides)."""
    return {"wd_mult": 0.0 if no_decay else 1.0, "lr_mult": 1.0, "is_expert_parallel": False,
            "is_decoupled_lr": False, "default_config": True}


def megatron_module_order(names: list[str]) -> list[int]:
    """Positions of one chunk's `named_parameters` names (ours) in megatron-core's order: within each
    `...self_attention.`, its `linear_proj` params first, everything else as it was."""
    keys = []
    first_of: dict[str, int] = {}
    for i, name in enumerate(names):
        head, sep, tail = name.partition(".self_attention.")
        if sep:
            keys.append((first_of.setdefault(head, i), 0 if tail.startswith("linear_proj.") else 1, i))
        else:
            keys.append((i, 0, i))
    return sorted(range(len(names)), key=keys.__getitem__)


def megatron_groups(chunks, groups: list[list[torch.Tensor]]) -> tuple[list[list[int]], list[str]]:
    """([g] -> indices into the flattened `groups` in megatron-core's order, name of each flat param)."""
    rank, name_of = {}, {}
    for chunk_index, chunk in enumerate(chunks):
        named = [(n, p) for n, p in chunk.named_parameters()]
        for position in megatron_module_order([n for n, _ in named]):
            name, p = named[position]
            rank.setdefault(id(p), len(rank))
            name_of.setdefault(id(p), name if len(chunks) == 1 else f"model{chunk_index}.{name}")
    flat = [p for g in groups for p in g]
    names = [name_of.get(id(p), f"param {i}") for i, p in enumerate(flat)]
    out, start = [], 0
    for g in groups:
        indices = list(range(start, start + len(g)))
        out.append(sorted(indices, key=lambda i: (rank.get(id(flat[i]), len(rank)), i)))
        start += len(g)
    return out, names


# ------------------------------------------------------------------ write

def to_megatron(inner: dict, groups: list[list[int]], mains: list[torch.Tensor], low: list[bool],
                scaler: dict | None, float16: bool, step: int) -> dict:
    """Megatron's entry from our inner torch state dict (state keyed by our flat index).

    `groups`: megatron_groups' lists; `mains[i]` our fp32 main weight of flat param i, `low[i]` whether
    the model param is bf16/fp16; `scaler`: the grad_scaler entry (None: none); `float16`: the
    Float16OptimizerWithFloat16Params layout (else FP32Optimizer's)."""
    state, param_groups, halves, k = {}, [], [], 0
    for live, indices in zip(inner["param_groups"], groups):
        params = []
        for i in indices:
            if i in inner["state"]:
                state[k] = inner["state"][i]
            params.append(k)
            k += 1
        param_groups.append({**live, "step": step, "params": params})
        halves.append([mains[i].detach().clone() for i in indices if low[i]])
    optimizer = {"state": state, "param_groups": param_groups}
    if not float16:
        return optimizer
    out = {"optimizer": optimizer, "fp32_from_fp16_params": halves}
    if scaler is not None:
        out["grad_scaler"] = scaler
    return out


def set_schedule_bounds(sd: dict, max_lr: float, min_lr: float) -> None:
    """The LR schedule's peak and floor into every group (megatron-core's scheduler reads a group's
    `max_lr` / `min_lr` before its own)."""
    for group in inner_state(sd)["param_groups"]:
        group["max_lr"], group["min_lr"] = float(max_lr), float(min_lr)


# ------------------------------------------------------------------ read

def is_megatron_layout(sd: dict) -> bool:
    """FP32Optimizer's (state at the top), or Float16OptimizerWithFloat16Params' (fp32_from_fp16_params
    one list per group; our previous layout has one flat list of tensors)."""
    if not isinstance(sd, dict):
        return False
    if "param_groups" in sd:
        return True
    halves = sd.get("fp32_from_fp16_params")
    return isinstance(halves, list) and bool(halves) and all(isinstance(h, list) for h in halves)


def inner_state(sd: dict, where=None) -> dict:
    """The torch optimizer state dict inside any layout (FP32Optimizer's is the entry itself);
    `where`: the file the entry was read from, named in the error."""
    inner = (sd if "param_groups" in sd else sd.get("optimizer")) if isinstance(sd, dict) else None
    if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list):
        prefix = f"{where}: " if where is not None else ""
        raise CheckpointError(f"{prefix}optimizer state: expected 'param_groups' (FP32Optimizer) or 'optimizer' -> "
                              "'param_groups' (Float16OptimizerWithFloat16Params, ours)")
    return inner


def match_groups(live: list[dict], saved: list[dict]) -> list[dict]:
    """The saved group for each live one: by megatron-core's identifier keys where both carry them
    (as its `_filter_and_reorder_param_groups`), else by position."""
    if len(saved) != len(live):
        raise CheckpointError(f"optimizer state: {len(saved)} param groups saved, this optimizer has {len(live)}")
    key = lambda g: tuple(g.get(k, g.get(f"pre_{k}")) for k in IDENTIFIER_KEYS)  # NeMo writes pre_wd_mult
    keyed = all(None not in key(g) for g in (*live, *saved))
    if keyed and len({key(g) for g in live}) == len(live) and len({key(g) for g in saved}) == len(saved):
        by_key = {key(g): g for g in saved}
        missing = [key(g) for g in live if key(g) not in by_key]
        if missing:
            raise CheckpointError(f"optimizer state: no saved param group with {dict(zip(IDENTIFIER_KEYS, missing[0]))}"
                                  f"; saved: {[dict(zip(IDENTIFIER_KEYS, k)) for k in by_key]}")
        return [by_key[key(g)] for g in live]
    return list(saved)


def hyper_parameters(live: dict, saved: dict) -> dict:
    """A live group updated with the saved one's hyper-parameters (not its params, step or how torch runs)."""
    skip = ("params", "step", *IMPLEMENTATION_KEYS)
    return {**live, **{k: v for k, v in saved.items() if k not in skip}}


def saved_step(inner: dict) -> int:
    """AdamW steps taken: torch keeps them per param, apex / TE FusedAdam per group."""
    for entry in inner.get("state", {}).values():
        if isinstance(entry, dict) and entry.get("step") is not None:
            return int(entry["step"])
    for group in inner["param_groups"]:
        if group.get("step") is not None and group.get("params"):
            return int(group["step"])
    return 0


def megatron_entries(sd: dict, groups: list[list[int]], model_params: list[torch.Tensor], names: list[str]):
    """Per flat param of ours: (saved state entry or {}, fp32 main weight or None for fp32 params),
    from Megatron's layout, placed by megatron_groups' order."""
    inner = inner_state(sd)
    saved_groups = inner["param_groups"]
    if len(saved_groups) != len(groups):
        raise CheckpointError(f"optimizer state: {len(saved_groups)} param groups saved, this model has {len(groups)}")
    halves = sd.get("fp32_from_fp16_params", [[] for _ in groups]) if "param_groups" not in sd else None
    if halves is not None and (not isinstance(halves, list) or len(halves) != len(groups)):
        raise CheckpointError(f"optimizer state: fp32_from_fp16_params should be one list per param group "
                              f"({len(groups)})")
    entries: list = [None] * len(model_params)
    for g, (indices, saved) in enumerate(zip(groups, saved_groups)):
        ids = saved.get("params", [])
        if len(ids) != len(indices):
            raise CheckpointError(f"optimizer state: param group {g} saved with {len(ids)} params, this model's "
                                  f"has {len(indices)}")
        low = iter(halves[g] if halves is not None else [])
        for i, k in zip(indices, ids):
            p = model_params[i]
            main = next(low, None) if p.dtype != torch.float32 else None
            if p.dtype != torch.float32 and main is None:
                raise CheckpointError(f"optimizer state: fp32_from_fp16_params of group {g} ends before "
                                      f"{names[i]} (a bf16/fp16 param)")
            entry = inner.get("state", {}).get(k, {})
            for what, tensor in (("main weight", main), *((key, entry.get(key)) for key in ("exp_avg", "exp_avg_sq"))):
                if tensor is not None and tuple(tensor.shape) != tuple(p.shape):
                    raise CheckpointError(f"optimizer state: {what} for {names[i]} (state {k}) has shape "
                                          f"{tuple(tensor.shape)}, the param has {tuple(p.shape)}")
            entries[i] = (entry, main)
    return entries
