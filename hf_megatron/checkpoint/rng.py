"""The RNG entry of a rank file, in the layout Megatron-LM resumes (megatron/training/
checkpointing.py `get_rng_state` / `load_checkpoint`, tag core_v0.16.1):

    rng_state = [ {                         one entry (one per dp rank with --data-parallel-random-init)
        random_rng_state    random.getstate()
        np_rng_state        np.random.get_state()    (the key array as an int64 tensor: loads with
                                                      weights_only, np.random.set_state takes it)
        torch_rng_state     torch.get_rng_state()
        cuda_rng_state      torch.cuda.get_rng_state()     Megatron-LM always restores it
        rng_tracker_states  {model-parallel-rng, data-parallel-rng, expert-parallel-rng}: CUDA
                            Philox states, megatron-core's tracker names
        cpu_rng_tracker_states  {model-parallel-rng: CPU generator state}: ours, so a CPU run
                            resumes its tensor-parallel dropout stream (Megatron-LM ignores it)
    } ]

A CUDA Philox state is 16 bytes, int64 [seed, offset].  Where a run has no CUDA stream to save
(CPU training), the entry holds the state that stream has in a CUDA run seeded the same way,
before any draw -- megatron-core's seeds, with `base` = seed + 100 * pp_rank as ours:

    cuda_rng_state        (base, 0)                   torch.manual_seed(base) seeds CUDA too
    model-parallel-rng    (base + 2718 + tp_rank, 0)  = the initial seed of our CPU TP stream
    data-parallel-rng     (base, 0)                   (always: we keep no separate stream for it)
    expert-parallel-rng   (base + 1024 + tp_rank, 0)  (always; ep_rank 0, expert TP = TP)

`restore` reads this layout and the one before it (tracker states named `cpu` / `cuda`), and
Megatron-LM's own files (numpy key arrays arrive as inert stand-ins and are decoded as data).
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ..parallel.random import TP_SEED_OFFSET

MODEL_PARALLEL = "model-parallel-rng"
DATA_PARALLEL = "data-parallel-rng"
EXPERT_PARALLEL = "expert-parallel-rng"
CPU_TRACKER = "cpu_rng_tracker_states"
EXPERT_SEED_OFFSET = 1024  # megatron-core's model_parallel_cuda_manual_seed


def philox_state(seed: int, offset: int = 0) -> torch.Tensor:
    """A CUDA generator state (uint8[16], uint64 seed then int64 offset), built on any machine.
    The seed wraps modulo 2^64 (an unseeded generator's seed is any uint64) and is stored in the
    same eight bytes as int64."""
    seed %= 2 ** 64
    return torch.tensor([seed - 2 ** 64 if seed >= 2 ** 63 else seed, offset], dtype=torch.int64).view(torch.uint8).clone()


def _seed_of(cpu_state: torch.Tensor) -> int:
    """The initial seed recorded in a CPU generator state."""
    generator = torch.Generator()
    generator.set_state(cpu_state)
    return generator.initial_seed()


def capture(tracker_states: dict[str, torch.Tensor], tp_rank: int) -> dict[str, Any]:
    """This process's RNG entry; `tracker_states`: our tensor-parallel stream ({'cpu', 'cuda'})."""
    base = torch.initial_seed()
    np_name, np_keys, np_pos, np_gauss, np_cached = np.random.get_state()
    cuda = torch.cuda.is_available()
    if "cuda" in tracker_states:
        model_parallel = tracker_states["cuda"].clone()
    elif "cpu" in tracker_states:
        model_parallel = philox_state(_seed_of(tracker_states["cpu"]))
    else:
        model_parallel = philox_state(base + TP_SEED_OFFSET + tp_rank)
    entry = {
        "random_rng_state": random.getstate(),
        "np_rng_state": (np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_gauss, np_cached),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if cuda else philox_state(base),
        "rng_tracker_states": {MODEL_PARALLEL: model_parallel, DATA_PARALLEL: philox_state(base),
                               EXPERT_PARALLEL: philox_state(base + EXPERT_SEED_OFFSET + tp_rank)},
    }
    if "cpu" in tracker_states:
        entry[CPU_TRACKER] = {MODEL_PARALLEL: tracker_states["cpu"].clone()}
    return entry


def _numpy_keys(keys: Any) -> np.ndarray | None:
    """The MT19937 key array: our int64 tensor, a real array, or the inert stand-in of a numpy
    array Megatron-LM pickled (state = (version, shape, dtype, fortran, raw bytes))."""
    if isinstance(keys, torch.Tensor):
        return keys.numpy().astype(np.uint32)
    if isinstance(keys, np.ndarray):
        return keys.astype(np.uint32)
    state = getattr(keys, "state", None)
    if isinstance(state, tuple) and len(state) == 5 and isinstance(state[4], (bytes, bytearray)):
        dtype = getattr(state[2], "args", None) or ("u4",)
        order = (getattr(state[2], "state", None) or (None, "<"))[1]
        kind = str(dtype[0])
        return np.frombuffer(bytes(state[4]), dtype=np.dtype(kind).newbyteorder(order if order in "<>" else "=")
                             ).astype(np.uint32)
    return None


def restore(entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Set random / numpy / torch (/ CUDA) generators from `entry`; returns our tensor-parallel
    tracker states found in it ({} when it has none this machine can use)."""
    random.setstate(entry["random_rng_state"])
    name, keys, pos, gauss, cached = entry["np_rng_state"]
    array = _numpy_keys(keys)
    if array is not None:
        np.random.set_state((name, array, pos, gauss, cached))
    torch.set_rng_state(entry["torch_rng_state"])
    cuda = torch.cuda.is_available()
    if cuda and isinstance(entry.get("cuda_rng_state"), torch.Tensor):
        torch.cuda.set_rng_state(entry["cuda_rng_state"])
    trackers = entry.get("rng_tracker_states") or {}
    if "cpu" in trackers:  # the layout before Megatron-LM's names
        return {k: v for k, v in trackers.items() if k == "cpu" or (k == "cuda" and cuda)}
    states = {}
    cpu_stream = (entry.get(CPU_TRACKER) or {}).get(MODEL_PARALLEL)
    if isinstance(cpu_stream, torch.Tensor):
        states["cpu"] = cpu_stream
    if cuda and isinstance(trackers.get(MODEL_PARALLEL), torch.Tensor):
        states["cuda"] = trackers[MODEL_PARALLEL]
    return states if "cpu" in states else {}
