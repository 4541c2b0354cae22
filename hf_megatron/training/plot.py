"""The loss-curve PNG written at the end of training (matplotlib, imported here so that a missing
matplotlib is an ImportError of this module only; the monitor then says it skipped the plot).

Drawn on a bare `Figure` with the Agg canvas: no pyplot, so no global backend is switched and
no window opens.  Written atomically (temporary file, then rename), with the mode open() would give it.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..checkpoint.files import _write_atomic


def write_loss_curve(path: str, train: list[tuple[int, float]], valid: list[tuple[int, float]]) -> str:
    """Train loss per iteration (and its running mean over ~2% of the run) and validation loss."""
    figure = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    steps, losses = zip(*train)
    width = max(1, len(losses) // 50)
    axes.plot(steps, losses, color="tab:blue", alpha=0.35 if width > 1 else 1.0, linewidth=0.8,
              label="train (per iteration)")
    if width > 1:
        prefix = [0.0]  # running sums: mean of losses[a:b] = (prefix[b] - prefix[a]) / (b - a)
        for x in losses:
            prefix.append(prefix[-1] + x)
        smooth = [(prefix[i + 1] - prefix[max(0, i + 1 - width)]) / (i + 1 - max(0, i + 1 - width))
                  for i in range(len(losses))]
        axes.plot(steps, smooth, color="tab:blue", linewidth=1.6, label=f"train (mean of {width})")
    if valid:
        v_steps, v_losses = zip(*valid)
        axes.plot(v_steps, v_losses, "o-", color="tab:orange", linewidth=1.6, label="validation")
    axes.set_xlabel("iteration")
    axes.set_ylabel("lm loss")
    axes.grid(True, alpha=0.3)
    axes.legend()
    if all(math.isfinite(x) and x > 0 for x in losses):
        axes.set_title(f"lm loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    figure.tight_layout()
    target = Path(os.path.abspath(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    # the checkpoint writer's temp + rename, which gives the file open()'s mode (0666 less the umask)
    _write_atomic(target, lambda tmp: figure.savefig(tmp, format="png"))
    return str(target)
