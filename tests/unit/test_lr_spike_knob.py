"""optim.test_lr_spike_*: the test-only knob that injects a ppo_kl spike multiplies the lr of
exactly one step's updates and restores it afterwards."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from trainer.config import TrainerConfig
from trainer.grpo import GRPOStep


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
