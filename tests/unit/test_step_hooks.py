"""Step hooks (trainer.hooks): a configured hook scales one step's lr on every rank and may end
the run; bad entries fail naming the field. The alerting test's spike (tests/support/lr_spike.py)
is one: it picks its step by wall time and ends the run one step after it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.common.config import ConfigError, build_config
from tests.support import lr_spike
from tests.support.fake_loop import FakeRanks, FakeStore, loop_config, pulled_group
from tests.support.lr_spike import TimedLrSpike
from trainer.config import TrainerConfig
from trainer.grpo import GRPOStep
from trainer.hooks import StepControl, load_hooks
from trainer.loop.loop import TrainLoop

SPIKE = "tests.support.lr_spike:TimedLrSpike"


def test_scaled_lr_multiplies_that_step_only_and_restores_it() -> None:
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    backend = SimpleNamespace(cfg=TrainerConfig(), checkpoint_state=lambda: (None, opt))
    step = GRPOStep(backend)  # type: ignore[arg-type]
    with step._scaled_lr(50.0):
        assert opt.param_groups[0]["lr"] == pytest.approx(50e-3)
    assert opt.param_groups[0]["lr"] == 1e-3
    with step._scaled_lr(1.0):  # the default never touches the optimizer
        assert opt.param_groups[0]["lr"] == 1e-3


class Script:
    """A hook that answers from a list (step -> control), recording what it was asked."""

    def __init__(self, controls: dict[int, dict]) -> None:
        self.controls, self.asked = controls, []

    def before_step(self, step: int, policy_version: int) -> StepControl:
        self.asked.append((step, policy_version))
        return StepControl(**self.controls.get(step, {}))


def test_every_rank_gets_the_hooks_scale_and_a_stop_ends_the_run(tmp_path) -> None:
    ranks, store = FakeRanks(2), FakeStore([pulled_group(i) for i in range(20)])
    first, second = Script({1: {"lr_scale": 4.0}}), Script({1: {"lr_scale": 0.5}, 3: {"stop": True}})
    history = TrainLoop(loop_config(tmp_path), ranks, store, hooks=[first, second]).run(10)
    assert len(history) == 3 and first.asked == second.asked == [(0, 0), (1, 1), (2, 2), (3, 3)]
    scales = [[args[1] for args in per_rank] for m, per_rank in ranks.calls if m == "train"]
    assert scales == [[1.0, 1.0], [2.0, 2.0], [1.0, 1.0]]


def test_hooks_are_config_entries_loaded_by_path(tmp_path) -> None:
    cfg = TrainerConfig(hooks=[{"path": SPIKE, "options": {"after_s": 5, "factor": 3}}])
    (hook,) = load_hooks(cfg.hooks)
    assert isinstance(hook, TimedLrSpike) and (hook.after_s, hook.factor) == (5, 3)
    loop = TrainLoop(loop_config(tmp_path).model_copy(update={"hooks": cfg.hooks}), FakeRanks(1),
                     FakeStore([]))
    assert [type(h) for h in loop.hooks] == [TimedLrSpike]
    assert TrainerConfig(hooks=["json:dumps"]).hooks[0].options == {}


@pytest.mark.parametrize(("hooks", "says"), [
    (["tests.support.lr_spike"], r"hooks\.0\.path: 'tests.support.lr_spike' is not of the form"),
    ([{"path": SPIKE, "extra": 1}], r"hooks\.0\.extra: unknown key")])
def test_a_malformed_entry_fails_validation_naming_the_field(hooks, says) -> None:
    with pytest.raises(ConfigError, match=says):
        build_config(TrainerConfig, {"hooks": hooks})


@pytest.mark.parametrize(("hook", "says"), [
    ("no_such_module_c45:f", r"^hooks\.0\.path: cannot import 'no_such_module_c45'"),
    ("tests.support.lr_spike:Nope", r"^hooks\.0\.path: module .* has no attribute 'Nope'"),
    ("tests.support.lr_spike:__doc__", r"^hooks\.0\.path: .* is not callable"),
    ("json:dumps", r"^hooks\.0\.options: json:dumps: .*"),
    ({"path": SPIKE, "options": {"after": 1}}, r"^hooks\.0\.options: .*unexpected keyword"),
    ({"path": "builtins:dict"}, r"^hooks\.0\.path: .* has no before_step")])
def test_a_hook_that_cannot_be_built_fails_at_load_naming_the_field(hook, says) -> None:
    with pytest.raises(ConfigError, match=says):
        load_hooks(TrainerConfig(hooks=[hook]).hooks)


def test_timed_spike_waits_for_its_seconds_then_ends_the_run_one_step_later(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(lr_spike.time, "monotonic", lambda: now[0])
    spike = TimedLrSpike(after_s=60.0, factor=40.0)
    assert spike.before_step(0, 0) == StepControl()  # before the first step: no clock yet
    assert spike.before_step(1, 1) == StepControl()  # the clock starts at 100 s
    now[0] = 159.0
    assert spike.before_step(1, 1) == StepControl()
    now[0] = 160.0
    assert spike.before_step(1, 1) == StepControl(lr_scale=40.0)  # the step to version 2
    assert spike.version == 2
    assert spike.before_step(2, 1) == StepControl(lr_scale=40.0)  # that step updated nothing
    assert spike.before_step(2, 2) == StepControl()  # once; the next step measures it
    assert spike.before_step(3, 3) == StepControl(stop=True)
