"""The parameter state -- what every optimizer checkpoint layout is read into -- and the earlier
layouts converted into it.

Parameter state (in memory; on disk our earlier distrib_optim.pt, one per model-parallel rank, which
still loads -- the distributed optimizer now writes megatron-core's layout, megatron_distrib_optim.py):

    {"numels": [n_0, n_1, ...],          one per param, in the optimizer's `model_params` order
     "step": k,                          AdamW steps taken
     "param": fp32 [sum n_i],            main weights, param i at [sum_{j<i} n_j, ... + n_i)
     "exp_avg": fp32 [...], "exp_avg_sq": fp32 [...]}

No dp padding is stored, so the state loads at any dp size.  The full layouts convert into it
(`parameter_state_from`):

* Megatron-LM's (what `MixedPrecisionOptimizer.state_dict()` writes into model_optim_rng.pt, and
  megatron-core's FP32Optimizer / Float16OptimizerWithFloat16Params): see
  megatron_optimizer_layout.py -- state numbered in megatron-core's param order;
* our previous full state: {"optimizer": torch state dict, "grad_scaler", "fp32_from_fp16_params":
  flat list}, AdamW state index i = param i, the list holding the main weights of the bf16/fp16 params;
* the former ZeRO-1's `optim_dp_RRR.pt` files, one per dp rank: each rank stepped whole params
  dealt largest first onto the least-loaded rank (ties: lower index, lower rank) and its
  AdamW state indexes its own params in `model_params` order.

fp32 params keep no main copy in either: their main weights are the model weights (loaded first).
"""
from __future__ import annotations

import torch

from ..errors import CheckpointError
from .megatron_optimizer_layout import inner_state, is_megatron_layout, megatron_entries, saved_step

MOMENTS = ("exp_avg", "exp_avg_sq")
STATE_KEYS = ("param", *MOMENTS)  # per param: fp32 main weight, then the Adam moments


def check_parameter_state(ps: dict, model_params: list[torch.Tensor]) -> None:
    numels = [p.numel() for p in model_params]
    if not isinstance(ps, dict) or not all(k in ps for k in ("numels", "step", "param", *MOMENTS)):
        raise CheckpointError("distrib_optim.pt: expected keys numels, step, param, exp_avg, exp_avg_sq")
    if list(ps["numels"]) != numels:
        raise CheckpointError(f"distrib_optim.pt: saved for {len(ps['numels'])} params of "
                              f"{sum(ps['numels'])} elements, this rank has {len(numels)} of {sum(numels)}")
    for key in STATE_KEYS:
        if not isinstance(ps[key], torch.Tensor) or ps[key].numel() != sum(numels):
            raise CheckpointError(f"distrib_optim.pt: {key} should be a tensor of {sum(numels)} elements")


def zero1_owners(model_params: list[torch.Tensor], dp: int) -> list[int]:
    """The former ZeRO-1's owner of each param (largest first onto the least-loaded dp rank)."""
    load, owner = [0] * dp, [0] * len(model_params)
    for i in sorted(range(len(model_params)), key=lambda i: (-model_params[i].numel(), i)):
        target = min(range(dp), key=lambda r: (load[r], r))
        owner[i] = target
        load[target] += model_params[i].numel()
    return owner


def _our_entries(states: list[dict], model_params: list[torch.Tensor]) -> list[tuple[dict, torch.Tensor | None]]:
    """Per param: (AdamW state entry or {}, fp32 main weight or None for fp32 params), from our
    previous full layout (`[sd]`) or the former ZeRO-1's per-dp-rank states."""
    owners = zero1_owners(model_params, len(states))
    position = [0] * len(states)  # next AdamW state index on each saved rank
    halves = [0] * len(states)  # next fp32_from_fp16_params entry on each saved rank
    entries = []
    for p, owner in zip(model_params, owners):
        sd = states[owner]
        entry = sd["optimizer"].get("state", {}).get(position[owner], {})
        position[owner] += 1
        main = None
        if p.dtype != torch.float32:
            saved = sd.get("fp32_from_fp16_params", [])
            if halves[owner] >= len(saved):
                raise CheckpointError(f"optimizer state (dp rank {owner}): fewer fp32_from_fp16_params than "
                                      f"the model's bf16/fp16 params")
            main = saved[halves[owner]]
            halves[owner] += 1
        entries.append((entry, main))
    return entries


def parameter_state_from(states: list[dict], model_params: list[torch.Tensor], order=None) -> dict:
    """A full optimizer state (`[sd]`: Megatron-LM's layout or our previous one) or the former
    ZeRO-1 states of dp ranks 0..dp-1 -> parameter state.  `order`: the optimizer's
    `megatron_order` (megatron_optimizer_layout.megatron_groups), needed for Megatron-LM's layout,
    whose state is numbered in megatron-core's param order."""
    if len(states) == 1 and is_megatron_layout(states[0]):
        if order is None:
            raise CheckpointError("optimizer state in Megatron-LM's layout: the param order (megatron_groups) is needed")
        entries = megatron_entries(states[0], order[0], model_params, order[1])
        step = saved_step(inner_state(states[0]))
    else:
        entries = _our_entries(states, model_params)
        step = next((int(e["step"]) for e, _ in entries if e.get("step") is not None), 0)
    flat = {key: [] for key in STATE_KEYS}
    for p, (entry, main) in zip(model_params, entries):
        main = p.detach() if main is None else main
        if main.numel() != p.numel():
            raise CheckpointError(f"optimizer state: a saved main weight has {main.numel()} elements, the param "
                                  f"has {p.numel()}")
        flat["param"].append(main.reshape(-1).float().cpu())
        for key in MOMENTS:
            moment = entry.get(key)
            if moment is not None and moment.numel() != p.numel():
                raise CheckpointError(f"optimizer state: a saved {key} has {moment.numel()} elements, the param "
                                      f"has {p.numel()}")
            flat[key].append(torch.zeros(p.numel()) if moment is None else moment.reshape(-1).float().cpu())
    numels = [p.numel() for p in model_params]
    return {"numels": numels, "step": step, **{k: torch.cat(v) if v else torch.zeros(0) for k, v in flat.items()}}
