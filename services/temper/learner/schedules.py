"""Controllers that change across steps: the learning rate and the KL coefficient.

Both are plain objects whose whole state is a few numbers (``state_dict``), so a checkpoint
stores them as JSON and a resumed run continues with exactly the same values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def lr_factor(step: int, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base LR for optimiser step ``step`` (0-based).

    Warm-up: (step + 1) / warmup_steps for the first ``warmup_steps`` steps. Then, with progress
    p = (step - warmup) / (total - warmup) clipped to [0, 1] and m = ``min_lr_ratio``:
    constant 1; linear m + (1 - m)(1 - p); cosine m + (1 - m)(1 + cos(pi p)) / 2.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    p = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    if schedule == "linear":
        return min_lr_ratio + (1 - min_lr_ratio) * (1 - p)
    if schedule == "cosine":
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    raise ValueError(f"unknown lr schedule {schedule!r}")


@dataclass
class LRController:
    """LR = base_lr * lr_factor(step) * scale.

    ``scale`` is the adaptive part (off when ``kl_target`` <= 0): after each update the policy's
    shift KL(pi_old || pi_new) is observed; above 2 * kl_target the scale is divided by
    ``factor``, below kl_target / 2 it is multiplied by it, kept in [min_scale, 1], so the
    schedule is an upper bound and the LR backs off while updates overshoot.
    """

    base_lr: float
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    min_lr_ratio: float = 0.0
    kl_target: float = 0.0
    factor: float = 1.5
    min_scale: float = 1e-3
    scale: float = 1.0

    def lr(self, step: int) -> float:
        return self.base_lr * lr_factor(step, self.schedule, self.warmup_steps, self.total_steps,
                                         self.min_lr_ratio) * self.scale

    def observe_kl(self, kl: float) -> None:
        if self.kl_target <= 0 or not math.isfinite(kl):
            return
        if kl > 2 * self.kl_target:
            self.scale = max(self.min_scale, self.scale / self.factor)
        elif kl < self.kl_target / 2:
            self.scale = min(1.0, self.scale * self.factor)

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


@dataclass
class KLController:
    """The coefficient beta of the KL(pi || pi_ref) penalty.

    Fixed when ``target`` <= 0. Adaptive otherwise (Ziegler et al. 2019): after a step whose
    measured KL (nats per token) is ``kl`` over ``n`` samples,
    beta <- beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon).
    """

    coef: float
    target: float = 0.0
    horizon: int = 10_000

    def update(self, kl: float, n: int) -> None:
        if self.target <= 0 or not math.isfinite(kl):
            return
        error = min(0.2, max(-0.2, kl / self.target - 1))
        self.coef *= 1 + error * n / self.horizon

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])
