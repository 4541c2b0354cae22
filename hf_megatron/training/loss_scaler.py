"""Loss scaling: a constant scale (fp32 / bf16: 1, or `--loss-scale`) or Megatron's dynamic scaler
for fp16 (DynamicGradScaler: halve after `hysteresis` overflowing steps, double after `window`
clean ones), with megatron-core's checkpoint entry."""
from __future__ import annotations

import torch

from ..errors import CheckpointError


class LossScaler:
    """Constant scale (fp32/bf16: 1) or Megatron's dynamic scaler for fp16."""

    def __init__(self, initial_scale: float = 1.0, dynamic: bool = False, min_scale: float = 1.0,
                 window: int = 1000, hysteresis: int = 2, backoff: float = 0.5, growth: float = 2.0) -> None:
        if initial_scale <= 0 or min_scale <= 0 or window < 1 or hysteresis < 1:
            raise ValueError("loss scaler: need initial/min scale > 0, window >= 1, hysteresis >= 1")
        self.scale, self.dynamic = float(initial_scale), dynamic
        self.min_scale, self.window, self.hysteresis = float(min_scale), window, hysteresis
        self.backoff, self.growth = backoff, growth
        self.good_steps, self.hysteresis_left = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
        else:
            self.good_steps += 1
            if self.good_steps == self.window:
                self.good_steps, self.hysteresis_left = 0, self.hysteresis
                self.scale *= self.growth

    @property
    def active(self) -> bool:
        """Whether the loss is scaled at all (fp16: dynamic, or a constant --loss-scale other than 1)."""
        return self.dynamic or self.scale != 1.0

    def state_dict(self) -> dict:
        """megatron-core's: DynamicGradScaler {scale: fp32 [1], trackers}; ConstantGradScaler {}."""
        if not self.dynamic:
            return {}
        return {"scale": torch.tensor([self.scale], dtype=torch.float32), "growth_tracker": self.good_steps,
                "hysteresis_tracker": self.hysteresis_left}

    def load_state_dict(self, sd: dict) -> None:
        """A dynamic scaler takes a saved dynamic one's state (scale as a number or a 1-element
        tensor); a constant one keeps its flag's scale (megatron-core skips it too)."""
        if not self.dynamic or not sd or "scale" not in sd:
            return
        try:
            self.scale = float(sd["scale"])
            self.good_steps, self.hysteresis_left = int(sd["growth_tracker"]), int(sd["hysteresis_tracker"])
        except (KeyError, TypeError, ValueError, RuntimeError):
            raise CheckpointError("optimizer state: grad_scaler should hold scale, growth_tracker and "
                                  "hysteresis_tracker") from None
