"""Learning-rate schedule in iterations, with Megatron's semantics.

With warmup W, decay horizon D (> W), peak `lr` and floor `min_lr`, the rate used at
iteration count n (n = number of optimizer steps already taken) is

    n <= W (W > 0):   lr * n / W                                  (linear warmup from 0)
    constant:         lr
    n > D:            min_lr
    otherwise, with r = (n - W) / (D - W):
        linear:       min_lr + (lr - min_lr) * (1 - r)
        cosine:       min_lr + (lr - min_lr) * (1 + cos(pi r)) / 2

As in Megatron the scheduler is stepped *after* each optimizer step, so the first step runs
at n = 0 (rate 0 when there is warmup).  Megatron-LM counts these in samples (iterations x
global batch size); the ratios are identical, so we count iterations and convert only in
`state_dict` / `load_state_dict`, which use Megatron's keys and units (`samples_per_iter` =
global batch size), so a checkpoint's `opt_param_scheduler` loads in either program.

Weight decay is constant (Megatron-LM's --weight-decay-incr-style constant, its default).  Given the
run's `weight_decay` and `train_iters`, `state_dict` also holds what Megatron-LM's scheduler has for
the same flags -- start_wd = end_wd = weight decay, wd_incr_style "constant", wd_incr_steps =
train_iters x global batch size -- which megatron-core's `load_state_dict` checks when present (a
--train-samples run's count, train_samples, is the same when it is a whole number of global batches).
"""
from __future__ import annotations

import math

DECAY_STYLES = ("constant", "linear", "cosine")


class LRScheduler:
    def __init__(self, optimizer, lr: float, min_lr: float = 0.0, warmup_iters: int = 0,
                 decay_iters: int | None = None, decay_style: str = "linear", samples_per_iter: int = 1,
                 weight_decay: float | None = None, train_iters: int | None = None) -> None:
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"lr_decay_style must be one of {DECAY_STYLES}, got {decay_style!r}")
        if not 0.0 <= min_lr <= lr:
            raise ValueError(f"need 0 <= min_lr <= lr, got min_lr={min_lr}, lr={lr}")
        if warmup_iters < 0:
            raise ValueError(f"lr_warmup_iters must be >= 0, got {warmup_iters}")
        if decay_iters is None:
            decay_iters = max(warmup_iters + 1, 1)
        if decay_style != "constant" and decay_iters <= warmup_iters:
            raise ValueError(f"lr_decay_iters ({decay_iters}) must exceed lr_warmup_iters ({warmup_iters})")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = float(lr), float(min_lr)
        self.warmup_iters, self.decay_iters, self.decay_style = warmup_iters, decay_iters, decay_style
        self.num_steps = 0
        self.samples_per_iter = samples_per_iter
        self.weight_decay, self.train_iters = weight_decay, train_iters  # for state_dict's weight-decay keys
        self._apply()

    def get_lr(self, num_steps: int | None = None) -> float:
        n = self.num_steps if num_steps is None else num_steps
        if self.warmup_iters > 0 and n <= self.warmup_iters:
            return self.max_lr * n / self.warmup_iters
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_iters:
            return self.min_lr
        ratio = (n - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _apply(self) -> None:
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        self._apply()

    @property
    def lr(self) -> float:
        return self.get_lr()

    def state_dict(self) -> dict:
        """Megatron's `opt_param_scheduler` entry (steps in samples)."""
        n = self.samples_per_iter
        out = {"max_lr": self.max_lr, "min_lr": self.min_lr, "lr_warmup_steps": self.warmup_iters * n,
               "lr_decay_steps": _whole(self.decay_iters * n), "lr_decay_style": self.decay_style,
               "num_steps": _whole(self.num_steps * n)}
        if self.weight_decay is not None and self.train_iters is not None:
            out.update(start_wd=float(self.weight_decay), end_wd=float(self.weight_decay), wd_incr_style="constant",
                       wd_incr_steps=_whole(self.train_iters * n))
        return out

    def load_state_dict(self, state: dict) -> None:
        """Resume the step count (the schedule's shape stays as configured, as Megatron's default)."""
        try:
            samples = int(state["num_steps"] if "num_steps" in state else state["num_iters"])
        except (KeyError, TypeError, ValueError):
            raise ValueError("opt_param_scheduler: expected an integer 'num_steps' entry") from None
        # a resume with another global batch size may stand between two of the new batches (4 samples
        # seen, batches of 8 now): the count goes on in fractions of an iteration, as Megatron-LM's goes
        # on in samples
        self.num_steps = samples // self.samples_per_iter if samples % self.samples_per_iter == 0 \
            else samples / self.samples_per_iter
        self._apply()


def _whole(samples):
    """A sample count as Megatron-LM stores it: an int (a --train-samples horizon is train_samples / global
    batch steps here, a float whose product with the batch is whole)."""
    return int(round(samples)) if abs(samples - round(samples)) < 1e-9 * max(1.0, abs(samples)) else samples
