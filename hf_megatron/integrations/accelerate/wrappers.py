"""The optimizer and scheduler `prepare` hands back.  The engine steps our optimizer and a
MegatronLMDummyScheduler's schedule inside `model(**batch)`, so their `step()` / `zero_grad()` do
nothing -- accelerate's MegatronLMOptimizerWrapper / MegatronLMSchedulerWrapper behave the same.
A transformers / torch scheduler (which accelerate's own Megatron-LM path refuses) is stepped by
the script's `scheduler.step()` as accelerate's AcceleratedScheduler steps it (`_user_steps`), and
our groups then take its lr.  Everything else (`param_groups`, `state_dict`, `get_last_lr`, ...)
reads our optimizer / schedule once the model is prepared (the user's object before that: objects
may be prepared in any order)."""
from __future__ import annotations

import warnings

import torch
from accelerate.utils import MegatronLMDummyScheduler

from ...parallel import state
from .engine import follow_user_lr


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


def _user_steps(accelerator) -> int:
    """Steps of a torch schedule per optimizer update: AcceleratedScheduler's `num_processes`, i.e.
    one step per batch of the loader as the script built it, so that a schedule sized from that
    (unprepared) loader, as accelerate's examples size it (`len(train_dataloader) * num_epochs //
    gradient_accumulation_steps`), spans the run.  Under Megatron the prepared loader (loaders.py)
    is sharded over the data-parallel ranks only (the tp / pp ranks of one replica read the same
    batches) and each of its batches is micro_batch_size x num_micro_batches samples, where the
    script's loader has batch_size = micro_batch_size: one update reads dp x num_micro_batches of
    the script's batches (at num_micro_batches 1: dp, where plain accelerate's is num_processes).
    (With split_batches AcceleratedScheduler steps once: the loader's batch is the whole update.)"""
    return state.get_state().dp * int(accelerator.state.megatron_lm_plugin.num_micro_batches or 1)


class PreparedScheduler(_Prepared):
    def __init__(self, original, accelerator):
        super().__init__(original, accelerator)
        # read when prepared, as accelerate builds its AcceleratedScheduler
        self.step_with_optimizer = accelerator.step_scheduler_with_optimizer
        self.split_batches = accelerator.split_batches

    def step(self, *args, **kwargs):
        """accelerate's AcceleratedScheduler.step for a torch schedule (scheduler.py); a no-op for a
        MegatronLMDummyScheduler (the engine steps that schedule after each update, as accelerate's)."""
        scheduler, acc = self.original, self._accelerator
        if isinstance(scheduler, MegatronLMDummyScheduler):
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the user's optimizer is never stepped: by design
            if not self.step_with_optimizer:  # no link to the optimizer: just step
                scheduler.step(*args, **kwargs)
            elif not acc.gradient_state.sync_gradients:  # a batch that only accumulated: no update
                if acc.gradient_state.adjust_scheduler:
                    scheduler._step_count += 1
            elif self._engine is not None and self._engine.skipped_iter:  # the update was skipped (overflow)
                return None
            else:
                for _ in range(1 if self.split_batches else _user_steps(acc)):
                    # accelerate's special case for OneCycleLR (`total_steps`) and a last short epoch
                    if not hasattr(scheduler, "total_steps") or scheduler._step_count <= scheduler.total_steps:
                        scheduler.step(*args, **kwargs)
        self.follow()
        return None

    def follow(self) -> None:
        """Our groups take the torch schedule's lr (engine.follow_user_lr), once bound."""
        engine = self._engine
        if engine is not None and engine.user_scheduler is self.original and engine.optimizer is not None:
            follow_user_lr(engine.optimizer, self.original)

    def _target(self):
        engine = self._engine
        if engine is None:
            return self.original
        return engine.scheduler if engine.scheduler is not None else engine.user_scheduler

    def get_last_lr(self) -> list[float]:
        if self._engine is None or not isinstance(self.original, MegatronLMDummyScheduler):
            return self.original.get_last_lr()  # a torch schedule: its own, per group of its optimizer (accelerate's)
        return [group["lr"] for group in self._engine.optimizer.param_groups]

    def get_lr(self) -> list[float]:
        return self.get_last_lr()

    def state_dict(self):
        return self._target().state_dict()

    def load_state_dict(self, state_dict):
        return self._target().load_state_dict(state_dict)
