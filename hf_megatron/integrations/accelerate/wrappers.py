"""The optimizer and scheduler `prepare` hands back.  The engine steps the real ones inside
`model(**batch)`, so `step()` / `zero_grad()` here do nothing -- accelerate's
MegatronLMOptimizerWrapper / MegatronLMSchedulerWrapper behave the same.  Everything else
(`param_groups`, `state_dict`, `get_last_lr`, ...) reads our optimizer / schedule once the model
is prepared (the user's object before that: objects may be prepared in any order)."""
from __future__ import annotations

import torch


class _Prepared:
    def __init__(self, original, accelerator):
        self.original = original
        self._accelerator = accelerator
        self._engine = None

    def bind(self, engine) -> None:
        self._engine = engine

    def step(self, *args, **kwargs):
        return None

    def zero_grad(self, *args, **kwargs):
        return None

    def _target(self):
        return self.original

    def __getattr__(self, name):
        if name.startswith("__") or name in ("original", "_accelerator", "_engine"):
            raise AttributeError(name)
        return getattr(self._target(), name)


class PreparedOptimizer(_Prepared, torch.optim.Optimizer):
    """A torch Optimizer by type (as accelerate's AcceleratedOptimizer), so a transformers / torch
    LR schedule can be built on it; such a schedule then sets our groups' lr directly."""

    def __init__(self, original, accelerator):  # Optimizer.__init__ is not called: nothing of its own
        _Prepared.__init__(self, original, accelerator)

    @property
    def defaults(self):
        return self.original.defaults

    @property
    def state(self):
        return self._target().state if self._engine is not None else self.original.state

    def _target(self):
        engine = self._engine
        return engine.optimizer if engine is not None and engine.optimizer is not None else self.original

    @property
    def param_groups(self):
        return self._target().param_groups

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last update was skipped (fp16 overflow)."""
        return bool(self._engine is not None and self._engine.skipped_iter)

    def state_dict(self):
        return self._target().state_dict()

    def load_state_dict(self, state_dict):
        return self._target().load_state_dict(state_dict)


class PreparedScheduler(_Prepared):
    def _target(self):
        engine = self._engine
        if engine is None:
            return self.original
        return engine.scheduler if engine.scheduler is not None else engine.user_scheduler

    def get_last_lr(self) -> list[float]:
        if self._engine is None:
            return self.original.get_last_lr()
        return [group["lr"] for group in self._engine.optimizer.param_groups]

    def get_lr(self) -> list[float]:
        return self.get_last_lr()

    def state_dict(self):
        return self._target().state_dict()

    def load_state_dict(self, state_dict):
        return self._target().load_state_dict(state_dict)
