"""The distributed optimizer's parameter state, and the earlier optimizer layouts converted into it.

Parameter state (distrib_optim.pt, one per model-parallel rank, written by dp rank 0):

    {"numels": [n_0, n_1, ...],          one per param, in the optimizer's `model_params` order
     "step": k,                          AdamW steps taken
     "param": fp32 [sum n_i],            main weights, param i at [sum_{j<i} n_j, ... + n_i)
     "exp_avg": fp32 [...], "exp_avg_sq": fp32 [...]}

No dp padding is stored, so the state loads at any dp size.  Two earlier layouts convert into it
(`parameter_state_from`):

* one full state (`MixedPrecisionOptimizer.state_dict()`, in model_optim_rng.pt): AdamW state
  index i = param i; `fp32_from_fp16_params` lists the main weights of the bf16/fp16 params;
* the former ZeRO-1's `optim_dp_RRR.pt` files, one per dp rank: each rank stepped whole params
  dealt largest first onto the least-loaded rank (ties: lower index, lower rank) and its
  AdamW state indexes its own params in `model_params` order.

fp32 params keep no main copy in either: their main weights are the model weights (loaded first).
"""
from __future__ import annotations

import torch

from ..errors import CheckpointError

MOMENTS = ("exp_avg", "exp_avg_sq")


def check_parameter_state(ps: dict, model_params: list[torch.Tensor]) -> None:
    numels = [p.numel() for p in model_params]
    if not isinstance(ps, dict) or not all(k in ps for k in ("numels", "step", "param", *MOMENTS)):
        raise CheckpointError("distrib_optim.pt: expected keys numels, step, param, exp_avg, exp_avg_sq")
    if list(ps["numels"]) != numels:
        raise CheckpointError(f"distrib_optim.pt: saved for {len(ps['numels'])} params of "
                              f"{sum(ps['numels'])} elements, this rank has {len(numels)} of {sum(numels)}")
    for key in ("param", *MOMENTS):
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


def parameter_state_from(states: list[dict], model_params: list[torch.Tensor]) -> dict:
    """A full optimizer state (`[sd]`) or the former ZeRO-1 states of dp ranks 0..dp-1 -> parameter state."""
    owners = zero1_owners(model_params, len(states))
    numels = [p.numel() for p in model_params]
    flat = {key: [] for key in ("param", *MOMENTS)}
    position = [0] * len(states)  # next AdamW state index on each saved rank
    halves = [0] * len(states)  # next fp32_from_fp16_params entry on each saved rank
    step = 0
    for p, owner in zip(model_params, owners):
        sd = states[owner]
        entry = sd["optimizer"].get("state", {}).get(position[owner], {})
        position[owner] += 1
        if p.dtype == torch.float32:
            main = p.detach().float()
        else:
            saved = sd.get("fp32_from_fp16_params", [])
            if halves[owner] >= len(saved):
                raise CheckpointError(f"optimizer state (dp rank {owner}): fewer fp32_from_fp16_params than "
                                      f"the model's bf16/fp16 params")
            main = saved[halves[owner]]
            halves[owner] += 1
        if main.numel() != p.numel():
            raise CheckpointError(f"optimizer state (dp rank {owner}): a saved main weight has {main.numel()} "
                                  f"elements, the param has {p.numel()}")
        flat["param"].append(main.reshape(-1).float().cpu())
        for key in MOMENTS:
            moment = entry.get(key)
            flat[key].append(torch.zeros(p.numel()) if moment is None else moment.reshape(-1).float().cpu())
        if entry.get("step") is not None:
            step = int(entry["step"])
    return {"numels": numels, "step": step, **{k: torch.cat(v) if v else torch.zeros(0) for k, v in flat.items()}}
