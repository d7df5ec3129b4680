"""optim.test_lr_spike_*: the test-only knob that injects a ppo_kl spike multiplies the lr of
exactly one step's updates and restores it afterwards; with test_lr_spike_after_s the loop picks
that step by wall time and ends the run one step after it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from trainer.checkpoint import DataPosition
from trainer.config import TrainerConfig
from trainer.grpo import GRPOStep
from trainer.loop import loop


def _step(spike_step: int, factor: float) -> tuple[GRPOStep, torch.optim.Optimizer]:
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    cfg = TrainerConfig.model_validate({"optim": {"test_lr_spike_step": spike_step,
                                                  "test_lr_spike_factor": factor}})
    backend = SimpleNamespace(cfg=cfg, checkpoint_state=lambda: (None, opt))
    return GRPOStep(backend), opt  # type: ignore[arg-type]


def test_spike_multiplies_lr_of_that_step_only() -> None:
    step, opt = _step(spike_step=3, factor=50.0)
    seen = []
    for version in range(5):  # the step to version v + 1
        step.policy_version = version
        with step._test_lr_spike():
            seen.append(opt.param_groups[0]["lr"])
    assert seen == [1e-3, 1e-3, 50e-3, 1e-3, 1e-3]


def test_default_never_touches_the_optimizer() -> None:
    step, opt = _step(spike_step=0, factor=1.0)
    with step._test_lr_spike():
        assert opt.param_groups[0]["lr"] == 1e-3


def test_set_version_moves_the_spike() -> None:
    step, opt = _step(spike_step=0, factor=20.0)
    step.lr_spike_version, step.policy_version = 4, 3
    with step._test_lr_spike():
        assert opt.param_groups[0]["lr"] == 20e-3
    assert opt.param_groups[0]["lr"] == 1e-3


def test_timed_spike_waits_for_its_seconds_then_ends_the_run_one_step_later(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: now[0])
    spike = loop._TimedLrSpike(after_s=60.0)
    pos = DataPosition()
    assert not spike.due(pos)  # before the first step: the clock has not started
    pos.step = pos.policy_version = 1
    assert not spike.due(pos) and not spike.shown(pos)  # the clock starts at 100 s
    now[0] = 159.0
    assert not spike.due(pos)
    now[0] = 160.0
    assert spike.due(pos) and spike.version == 2  # the step to version 2 spikes
    assert not spike.due(pos)  # once
    pos.step = pos.policy_version = 2
    assert not spike.shown(pos)  # the next step measures it
    pos.step = pos.policy_version = 3
    assert spike.shown(pos)


def test_timed_spike_off_by_default() -> None:
    spike = loop._TimedLrSpike(after_s=0.0)
    pos = DataPosition(step=50, policy_version=50)
    assert not spike.due(pos) and not spike.shown(pos)
