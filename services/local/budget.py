"""The time budget of one `r3flow local` run (issue 46): derived from the steps asked for
(boot allowance + an allowance per step, raised to the measured rate) or fixed by timeout_s, and
the error a run past it ends with."""

from __future__ import annotations

import dataclasses

from services.local.config import LocalConfig, resolved

OUT_OF_BUDGET_EXIT = 124  # the exit code of a run past its budget (as timeout(1))

# After this many steps the measured rate is checked: a per-step allowance that `RATE_MARGIN`
# x the measured seconds a step would overrun is raised to that (a slow box is not a failure;
# a run that stopped stepping still is).
MEASURED_AFTER_STEPS = 5
RATE_MARGIN = 2.0


class OutOfBudget(RuntimeError):
    """The run outlived its budget (Budget) before its last step."""

    def __init__(self, budget: Budget, step: int) -> None:
        self.budget, self.step, self.steps = budget, step, budget.steps
        super().__init__(self.message(step))

    def message(self, step: int) -> str:
        """The one line: the budget, what it was made of, and the step the run reached."""
        return (f"budget of {self.budget.deadline():.0f} s ({self.budget.describe()}) ran out "
                f"at GRPO step {step} of {self.steps}")


class Stalled(OutOfBudget):
    """No GRPO step for several times the recent step time (monitor.StallWatch): the run stops
    now, naming the component and the cause, instead of waiting out its budget."""

    def __init__(self, budget: Budget, step: int, component: str, cause: str,
                 idle_s: float) -> None:
        self.component, self.cause, self.idle_s = component, cause, idle_s
        super().__init__(budget, step)

    def message(self, step: int) -> str:
        return (f"stalled at GRPO step {step} of {self.steps} (no step for {self.idle_s:.0f} s): "
                f"{self.component}: {self.cause}")


@dataclasses.dataclass
class Budget:
    """The run's time budget in seconds from its start: `fixed` (timeout_s), or `boot_s` to
    the first GRPO step plus `step_s` for each step after it; `step_s` follows the measured
    rate (raised to RATE_MARGIN x the median step) once MEASURED_AFTER_STEPS steps are in."""

    steps: int
    boot_s: float
    step_s: float
    follows_rate: bool
    fixed: float | None = None
    first_step_at: float | None = None  # seconds from the run's start
    measured_s: float | None = None  # the median step, once measured

    @classmethod
    def of(cls, cfg: LocalConfig) -> Budget:
        return cls(resolved(cfg, "trainer").run.steps, cfg.budget_boot_s, cfg.budget_step_s,
                   cfg.budget_follows_rate, cfg.timeout_s)

    def total(self) -> float:
        """Seconds from the run's start the whole run may take, as far as known now."""
        if self.fixed is not None:
            return self.fixed
        start = self.boot_s if self.first_step_at is None else self.first_step_at
        return start + (self.steps - 1) * self.step_s

    def deadline(self) -> float:
        """Seconds from the run's start by which the next thing must have happened: the first
        step (within boot_s), then the last."""
        if self.fixed is None and self.first_step_at is None:
            return self.boot_s
        return self.total()

    def describe(self) -> str:
        if self.fixed is not None:
            return "timeout_s"
        start = (f"{self.boot_s:.0f} s to the first step" if self.first_step_at is None
                 else f"first step at {self.first_step_at:.0f} s")
        return (f"{start} + {self.steps - 1} more x "
                f"{self.step_s:.3g} s" + (f" (2x the measured {self.measured_s:.1f} s a step)"
                                          if self.measured_s and self.follows_rate
                                          and self.step_s == RATE_MARGIN * self.measured_s
                                          else ""))

    def over(self, elapsed: float) -> bool:
        return elapsed > self.deadline()

    def update(self, step_times: list[float], elapsed: float) -> str | None:
        """With the steps logged so far (their wall times): start the step clock at the first,
        and once MEASURED_AFTER_STEPS more are in, measure the rate; a line to print, or None."""
        if step_times and self.first_step_at is None:
            self.first_step_at = elapsed
        if self.measured_s is not None or len(step_times) < MEASURED_AFTER_STEPS + 1:
            return None
        gaps = sorted(b - a for a, b in zip(step_times, step_times[1:], strict=False))
        self.measured_s = gaps[len(gaps) // 2]  # median; step 1 (boot, empty store) left out
        left = self.steps - len(step_times)
        line = (f"budget: {self.measured_s:.1f} s a step measured over steps 2-"
                f"{len(step_times)}: the {self.steps} steps end in ~"
                f"{elapsed + left * self.measured_s:.0f} s")
        if self.fixed is None and self.follows_rate and RATE_MARGIN * self.measured_s > self.step_s:
            self.step_s = RATE_MARGIN * self.measured_s
            line += f"; per-step allowance raised to {self.step_s:.1f} s"
        return line + f" (budget {self.total():.0f} s)"
