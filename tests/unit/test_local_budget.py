"""`r3flow local`'s time budget (services.local.budget.Budget, issue 46): derived from the steps
asked for, raised to the measured rate, or fixed by timeout_s."""

from __future__ import annotations

import pytest

from services.local.budget import Budget, OutOfBudget
from services.local.config import LocalConfig


def _budget(**kw) -> Budget:
    return Budget.of(LocalConfig.model_validate({"trainer": {"run": {"steps": 40}}, **kw}))


def test_derived_budget_boot_then_steps():
    b = _budget(budget_boot_s=100, budget_step_s=10)
    assert b.total() == 100 + 39 * 10 and b.deadline() == 100
    assert not b.over(99) and b.over(101)  # the first step must come within the boot allowance
    assert b.update([1000.0], elapsed=50) is None  # step 1 logged 50 s into the run
    assert b.deadline() == b.total() == 50 + 39 * 10
    assert not b.over(439) and b.over(441)
    assert str(OutOfBudget(b, 7)) == ("budget of 440 s (first step at 50 s + 39 more x 10 s) "
                                      "ran out at GRPO step 7 of 40")
    assert OutOfBudget(b, 7).message(9).endswith("at GRPO step 9 of 40")


def test_a_slow_measured_rate_raises_the_step_allowance_a_fast_one_does_not():
    slow, fast = _budget(budget_step_s=10), _budget(budget_step_s=10)
    times = [1000.0 + 12 * i for i in range(6)]  # 12 s a step
    slow.update(times[:1], elapsed=60)
    line = slow.update(times, elapsed=120)
    assert slow.measured_s == 12 and slow.step_s == 24 and "raised to 24" in line
    assert slow.total() == 60 + 39 * 24
    fast.update(times[:1], elapsed=60)
    fast.update([1000.0 + 3 * i for i in range(6)], elapsed=75)
    assert fast.measured_s == 3 and fast.step_s == 10  # 2 x 3 s is within the allowance
    assert fast.update([1000.0 + 3 * i for i in range(7)], elapsed=78) is None  # measured once


@pytest.mark.parametrize("follows", [True, False])
def test_fixed_or_not_following_the_rate_is_never_raised(follows):
    b = _budget(budget_step_s=1, budget_follows_rate=follows, timeout_s=None if not follows
                else 30)
    b.update([1000.0 + 10 * i for i in range(6)], elapsed=80)
    assert b.step_s == 1 and b.measured_s == 10
    assert b.total() == (30 if follows else 80 + 39 * 1)


def test_measure_every_reaches_the_trainer_and_picks_step_1_then_every_nth(tmp_path):
    """The preset measures on every 4th step (the trainer's replay.compare_off_every and
    loss.kl_metric_every): the reference pass runs from versions 0, 4, 8 (steps 1, 5, 9), every step with kl_coef."""
    from services.local.config import trainer_config
    from trainer.config import TrainerConfig

    conf = trainer_config(LocalConfig(), tmp_path, tmp_path / "model")
    cfg = TrainerConfig.model_validate(conf)
    assert cfg.replay.compare_off_every == cfg.loss.kl_metric_every == 4
    assert cfg.data.micro_batch_size == 256
    assert [v for v in range(10) if cfg.loss.reference_due(v)] == [0, 4, 8]
    with_kl = cfg.loss.model_copy(update={"kl_coef": 0.1})
    assert all(with_kl.reference_due(v) for v in range(10))
