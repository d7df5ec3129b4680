"""The learning-rate schedule: the lr of a step as a pure function of the step number.

The optimizer is built at `optim.lr`; before each step the loop scales that step's updates by
`lr_factor(optim, step)` (with any step hook's scale, trainer.hooks), through the same path the
hooks use. The factor depends on the step number alone, which the checkpoint holds
(trainer.checkpoint.DataPosition.step), so a resumed run continues the very sequence an
uninterrupted one takes: no scheduler state to save.

Schedules (`optim.lr_schedule`), each after `optim.warmup_steps` of linear warmup from
lr / warmup_steps up to lr (step s of the warmup, 0-based, runs at lr x (s + 1) / warmup_steps):
- constant: lr;
- cosine: from lr down to `optim.min_lr` over `optim.decay_steps` steps (counted after the
  warmup; default: the rest of `run.steps`), min_lr after that.
"""

from __future__ import annotations

import math
from typing import Protocol


class ScheduleKnobs(Protocol):
    """The optimizer section's schedule fields (trainer.config.OptimConfig)."""

    @property
    def lr(self) -> float: ...
    @property
    def lr_schedule(self) -> str: ...
    @property
    def warmup_steps(self) -> int: ...
    @property
    def decay_steps(self) -> int | None: ...
    @property
    def min_lr(self) -> float: ...


def lr_factor(o: ScheduleKnobs, step: int, run_steps: int = 0) -> float:
    """lr of the step taken after `step` completed steps, as a multiple of `o.lr`."""
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.lr_schedule == "constant":
        return 1.0
    decay = o.decay_steps if o.decay_steps is not None else run_steps - o.warmup_steps
    floor = o.min_lr / o.lr
    done = min(1.0, (step - o.warmup_steps) / decay) if decay > 0 else 1.0
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * done))


def learning_rate(o: ScheduleKnobs, step: int, run_steps: int = 0) -> float:
    """The lr (absolute) of the step taken after `step` completed steps."""
    return o.lr * lr_factor(o, step, run_steps)
