"""A step hook (trainer.hooks) that injects a ppo_kl spike: the alerting test names it in its
run config (tests/integration/local_fixtures.py).

The loop picks the spiking step by wall time, so a run holds low ppo_kl for long enough however
fast the machine steps: the first step that starts `after_s` seconds after the run's first step
ended runs at lr x `factor`, and the run ends one step later (that step's batch, sampled by the
policy before the jump, shows the spike).
"""

from __future__ import annotations

import time

from trainer.hooks import StepControl


class TimedLrSpike:
    """`before_step` of the hook: see the module docstring."""

    def __init__(self, after_s: float, factor: float) -> None:
        if after_s <= 0 or factor <= 0:
            raise ValueError(f"after_s {after_s} and factor {factor} must be > 0")
        self.after_s, self.factor = after_s, factor
        self.first_step_end, self.version = 0.0, 0

    def before_step(self, step: int, policy_version: int) -> StepControl:
        if self.version:
            if policy_version < self.version:  # the spiking step updated nothing: again
                return StepControl(lr_scale=self.factor)
            # spiked: the step after it measures it, then the run ends
            return StepControl(stop=policy_version > self.version)
        if not self.first_step_end:
            if step:  # the first step is taken: time counts from now (before the next)
                self.first_step_end = time.monotonic()
            return StepControl()
        if time.monotonic() - self.first_step_end < self.after_s:
            return StepControl()
        self.version = policy_version + 1
        return StepControl(lr_scale=self.factor)
