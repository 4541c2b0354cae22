"""The RNG entry of a resharded rank file (`hf-megatron reshard --with-optimizer`).

RNG streams belong to ranks, and a layout change leaves no rank-to-rank correspondence to carry
them by exactly, so the rule keeps what can be kept and seeds the rest as a fresh run at the
new layout seeds it (parallel/random.py, checkpoint/rng.py; `seed` = the run's `args.seed`,
base = seed + 100 * pp_rank):

    default streams (python, numpy, torch CPU + CUDA, data-parallel-rng) of target stage p:
        those of source rank (tp 0, stage p) when the source has a stage p (every tp rank of a
        stage holds the same default streams, and must: replicated activations share dropout);
        else python / numpy of source rank (0, 0) and torch / CUDA / data-parallel seeded `base`
    tensor-parallel stream (model-parallel-rng, its CPU copy, expert-parallel-rng) of target
    rank (t, p): that of source rank (t, p) when the source has it; else seeded
        base + 2718 + t (expert: base + 1024 + t), as a fresh run's rank (t, p) starts.

So a reshard that keeps tp and pp keeps every stream, and streams that must differ between
ranks (tensor-parallel dropout) never repeat one another.  With dropout off no loss depends on it.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from ..checkpoint.rng import CPU_TRACKER, DATA_PARALLEL, EXPERT_PARALLEL, EXPERT_SEED_OFFSET, MODEL_PARALLEL, philox_state
from ..parallel.random import TP_SEED_OFFSET


def _cpu_state(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


def _tracker_streams(entry: dict) -> dict | None:
    """The tensor-parallel streams of an entry in Megatron-LM's layout (None for older layouts)."""
    trackers = entry.get("rng_tracker_states") or {}
    if MODEL_PARALLEL not in trackers:
        return None
    return {"rng_tracker_states": {k: v for k, v in trackers.items() if k != DATA_PARALLEL},
            CPU_TRACKER: entry.get(CPU_TRACKER)}


def _fresh_tracker(base: int, tp_rank: int) -> dict:
    stream = base + TP_SEED_OFFSET + tp_rank
    return {"rng_tracker_states": {MODEL_PARALLEL: philox_state(stream),
                                   EXPERT_PARALLEL: philox_state(base + EXPERT_SEED_OFFSET + tp_rank)},
            CPU_TRACKER: {MODEL_PARALLEL: _cpu_state(stream)}}


def first_entry(rng_state: Any) -> dict | None:
    """dp rank 0's entry of a rank file's `rng_state` (a list, or one entry); None when absent."""
    entry = rng_state[0] if isinstance(rng_state, list) and rng_state else rng_state
    return entry if isinstance(entry, dict) and "torch_rng_state" in entry else None


def resharded_rng_entry(source_entry, seed: int, tp_rank: int, stage: int, src_tp: int, src_pp: int) -> dict | None:
    """The entry of target rank (tp_rank, stage).  `source_entry(t, p)`: dp rank 0's entry of
    source rank (t, p) (or None).  None when the source saved no RNG state at all."""
    base = seed + 100 * stage
    defaults = source_entry(0, stage) if stage < src_pp else source_entry(0, 0)
    if defaults is None:
        return None
    entry = copy.deepcopy(defaults)
    if stage >= src_pp:  # no such stage in the source: its streams as a fresh run seeds them
        entry.update(torch_rng_state=_cpu_state(base), cuda_rng_state=philox_state(base))
    trackers = entry.setdefault("rng_tracker_states", {})
    trackers.pop("cpu", None), trackers.pop("cuda", None)  # the layout before Megatron-LM's names
    if stage >= src_pp:
        trackers[DATA_PARALLEL] = philox_state(base)
    own = source_entry(tp_rank, stage) if tp_rank < src_tp and stage < src_pp else None
    streams = _tracker_streams(own) if own is not None else None
    streams = copy.deepcopy(streams) if streams is not None else _fresh_tracker(base, tp_rank)
    trackers.update(streams["rng_tracker_states"])
    entry.pop(CPU_TRACKER, None)
    if streams.get(CPU_TRACKER):
        entry[CPU_TRACKER] = streams[CPU_TRACKER]
    return entry
