"""RNG streams for dropout under tensor parallelism (Megatron's CudaRNGStatesTracker idea).

Two streams:
* the default torch generator, seeded ``seed + 100 * pp_rank``: the same on every TP rank, so
  dropout on replicated activations (hidden dropout, or SP shards that were replicated before
  the split) agrees across the TP group;
* the "tensor-parallel" stream, seeded ``seed + 2718 + tp_rank``: different on every TP rank,
  used for dropout on sharded activations (attention probabilities of local heads) so that the
  shards do not repeat the same mask.

`tp_rng()` is a context manager that swaps the tensor-parallel stream in and out on the device
the activations live on (CPU generator, or the current CUDA device's).
"""
from __future__ import annotations

import contextlib

import torch

from . import state

TP_SEED_OFFSET = 2718


class RNGTracker:
    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.cuda = False

    def seed(self, seed: int) -> None:
        st = state.get_state()
        base = seed + 100 * st.coords["pp"]
        self.cuda = torch.cuda.is_available()
        torch.manual_seed(base)  # seeds CPU and every CUDA device
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if self.cuda else None
        torch.manual_seed(base + TP_SEED_OFFSET + st.coords["tp"])
        self.states = {"cpu": torch.get_rng_state()}
        if self.cuda:
            self.states["cuda"] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(saved_cuda)
        torch.set_rng_state(saved_cpu)

    @contextlib.contextmanager
    def fork(self):
        if not self.states:
            yield
            return
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if self.cuda else None
        torch.set_rng_state(self.states["cpu"])
        if self.cuda:
            torch.cuda.set_rng_state(self.states["cuda"])
        try:
            yield
        finally:
            self.states["cpu"] = torch.get_rng_state()
            torch.set_rng_state(saved_cpu)
            if self.cuda:
                self.states["cuda"] = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(saved_cuda)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


_TRACKER = RNGTracker()


def get_tracker() -> RNGTracker:
    return _TRACKER


def model_parallel_seed(seed: int) -> None:
    """Seed both streams for this rank (call after `state.initialize`)."""
    _TRACKER.seed(seed)


def tp_rng():
    return _TRACKER.fork()


def replayable(fn):
    """Wrap `fn` for activation checkpointing so that its recomputation replays the same
    tensor-parallel dropout stream as the first run (torch's checkpoint restores only the default
    generator; without this the recompute would draw new masks and advance the stream)."""
    saved = _TRACKER.get_states()
    calls = [0]

    def run(*args):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*args)
        current = _TRACKER.get_states()
        _TRACKER.set_states(saved)
        try:
            return fn(*args)
        finally:
            _TRACKER.set_states(current)

    return run
