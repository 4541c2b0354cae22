"""When a run stops early, as Megatron-LM's exit flags say: save, then exit 0.

    --exit-signal-handler      SIGTERM or SIGINT: finish the current step, save, exit
    --exit-interval N          after an iteration that is a multiple of N
    --exit-duration-in-mins M  once M minutes have passed since training started

The signal handler only records the signal; the loop asks `ExitConditions.reason(iteration)`
after each step.  Under torch.distributed the ranks agree (MAX all-reduce of the flags), so a
signal seen by one rank stops all of them at the same step -- every rank must take part in the
save.  The first signal is absorbed; a second one of the same kind acts as the default would
(so a stuck run can still be interrupted).
"""
from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ExitConditions:
    def __init__(self, exit_interval: int | None = None, exit_duration_in_mins: float | None = None,
                 signal_handler: bool = False) -> None:
        self.exit_interval, self.duration_s = exit_interval, (exit_duration_in_mins or 0) * 60.0 or None
        self.started, self.received = time.monotonic(), None
        self._previous = {}
        if signal_handler:
            for sig in EXIT_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.received == signum:  # the second one: behave as if we had not been installed
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.received = signum

    def reason(self, iteration: int) -> str | None:
        """Why to stop after `iteration` (None: go on)."""
        flags = [float(self.received is not None),
                 float(self.duration_s is not None and time.monotonic() - self.started >= self.duration_s)]
        if (self._previous or self.duration_s) and dist.is_available() and dist.is_initialized():
            t = torch.tensor(flags)
            if dist.get_backend() == "nccl":
                t = t.cuda()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flags = t.tolist()
        if flags[0]:
            name = signal.Signals(self.received).name if self.received else "a signal (on another rank)"
            return f"received {name}"
        if flags[1]:
            return f"--exit-duration-in-mins {self.duration_s / 60:g} reached"
        if self.exit_interval and iteration % self.exit_interval == 0:
            return f"--exit-interval {self.exit_interval} reached"
        return None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
