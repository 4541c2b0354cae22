"""Training steps whose host read comes one step late (--defer-step-stats).

`train_step` ends in one host sync (loss, token count, grad norm), so the GPU sits idle from the end
of each step's update until the host has run the next step's prologue and launched its first
kernels (session 5's GPT-2 medium profile, bench/RESULTS.md: two ~1.5 ms idle gaps after the sync,
the prologue and the first compiled layer's guards).  `DeferredSteps.step(batch)`
issues the same device work in the same order and moves only the read:

    launch the update of the step queued last time   (its lr: the schedule after the step before)
    queue this batch's forward and backward
    read the previous step's stats                    (waits for that step's update only)

so the host waits while the GPU already has the next forward and backward queued.  It returns the
previous step's stats (None on the first call); `finish()` launches and reads the last one.
Between a returned step and the next call the model holds that step's weights, optimizer state and
LR schedule (the queued forward and backward have not touched them): evaluation and checkpoints
see what they would see after `train_step`.  Only the RNG has moved on, through the queued
forward's dropout: `rng_state()` is the state as of the end of the returned step, for a checkpoint.
A step whose caller stops (an exit, a non-finite loss) before the next call is never updated.
With an fp16 loss scaler the update itself reads the grads on the host, so nothing overlaps there
(the result is the same).
"""
from __future__ import annotations

from typing import Any

from .checkpoint import get_rng_state
from .trainer import QueuedStep, queue_forward_backward, queue_update, read_step


class DeferredSteps:
    def __init__(self, chunks, optimizer, scheduler) -> None:
        self.chunks, self.optimizer, self.scheduler = list(chunks), optimizer, scheduler
        self._queued: QueuedStep | None = None  # forward and backward queued, update not launched
        self._rng_after: dict[str, Any] | None = None  # the RNG as the returned step left it

    def step(self, micro_batches: list[dict]) -> dict[str, Any] | None:
        """Queue this step; the previous step's stats (as `train_step` returns them), or None."""
        launched = self._launch()
        rng_before = get_rng_state()
        self._queued = queue_forward_backward(self.chunks, self.optimizer, micro_batches)
        if launched is None:
            return None
        stats = read_step(launched, self.optimizer, self.scheduler)
        self._rng_after = rng_before
        return stats

    def finish(self) -> dict[str, Any] | None:
        """Launch and read the step queued last (None if there is none)."""
        launched = self._launch()
        if launched is None:
            return None
        self._rng_after = None
        return read_step(launched, self.optimizer, self.scheduler)

    def rng_state(self) -> dict[str, Any]:
        """The RNG entry of a checkpoint of the last returned step."""
        return self._rng_after if self._rng_after is not None else get_rng_state()

    def _launch(self) -> QueuedStep | None:
        step, self._queued = self._queued, None
        if step is not None:
            queue_update(step, self.chunks, self.optimizer, copy=True)
        return step
