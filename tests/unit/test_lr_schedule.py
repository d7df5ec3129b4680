"""The lr schedule (trainer.lr_schedule): constant, linear warmup and cosine with a floor, taken
by the loop as each step's lr scale; a run resumed from a checkpoint continues the same lr
sequence as an uninterrupted one."""

from __future__ import annotations

import math

import pytest

from services.common.config import ConfigError, build_config
from tests.support.fake_loop import FakeRanks, FakeStore, loop_config, pulled_group
from trainer.config import TrainerConfig
from trainer.loop.loop import TrainLoop


def _cfg(steps: int = 10, **optim) -> TrainerConfig:
    return TrainerConfig(optim={"lr": 1e-3, **optim}, run={"steps": steps})


def test_constant_is_lr_at_every_step() -> None:
    cfg = _cfg()
    assert [cfg.learning_rate(s) for s in range(12)] == [1e-3] * 12


def test_linear_warmup_climbs_to_lr_then_holds() -> None:
    cfg = _cfg(warmup_steps=4)
    assert [cfg.learning_rate(s) for s in range(6)] == pytest.approx(
        [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_cosine_decays_from_lr_to_min_lr_over_the_rest_of_the_run() -> None:
    cfg = _cfg(steps=10, lr_schedule="cosine", warmup_steps=2, min_lr=1e-4)
    lrs = [cfg.learning_rate(s) for s in range(12)]
    assert lrs[:3] == pytest.approx([5e-4, 1e-3, 1e-3])
    # halfway through its 8 decay steps: the mean of lr and min_lr
    assert lrs[6] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert lrs[6] == pytest.approx(5.5e-4)
    assert all(a > b for a, b in zip(lrs[2:10], lrs[3:10], strict=False))
    assert lrs[10:] == pytest.approx([1e-4, 1e-4])  # past the decay: the floor


def test_cosine_decay_steps_set_explicitly() -> None:
    cfg = TrainerConfig(optim={"lr": 1e-3, "lr_schedule": "cosine", "decay_steps": 4},
                        run={"steps": 0})
    assert [cfg.learning_rate(s) for s in (0, 2, 4, 9)] == pytest.approx([1e-3, 5e-4, 0, 0])


@pytest.mark.parametrize(("raw", "says"), [
    ({"optim": {"lr_schedule": "cosine", "warmup_steps": 5}, "run": {"steps": 5}},
     r"optim\.decay_steps: cosine needs it"),
    ({"optim": {"lr_schedule": "cosine"}, "run": {"steps": 0}}, r"optim\.decay_steps"),
    ({"optim": {"lr": 1e-5, "min_lr": 1e-4}}, r"optim\.min_lr: .* above optim\.lr"),
    ({"optim": {"lr_schedule": "linear"}}, r"optim\.lr_schedule")])
def test_a_bad_schedule_names_its_field(raw, says) -> None:
    with pytest.raises(ConfigError, match=says):
        build_config(TrainerConfig, raw)


class SavingRanks(FakeRanks):
    """FakeRanks whose checkpoint holds the data position `save` got (what `resume` returns)."""

    def __init__(self, world_size: int, saved: list) -> None:
        super().__init__(world_size)
        self.saved = saved

    def call(self, method, per_rank_args):
        if method == "save":
            self.saved.append(per_rank_args[0][0])
        if method == "resume":
            self.calls.append((method, per_rank_args))
            return [self.saved[-1] if self.saved else None] * self.world_size
        return super().call(method, per_rank_args)


def _lrs(ranks: FakeRanks) -> list[float]:
    return [per_rank[0][1] for m, per_rank in ranks.calls if m == "train"]


def _run(cfg: TrainerConfig, ranks: FakeRanks, store: FakeStore, steps: int) -> list[dict]:
    loop = TrainLoop(cfg, ranks, store)
    loop.resume()
    return loop.run(steps)


def test_a_resumed_run_continues_the_uninterrupted_lr_sequence(tmp_path) -> None:
    cfg = loop_config(tmp_path).model_copy(update={
        "optim": _cfg(lr_schedule="cosine", warmup_steps=2, min_lr=1e-4).optim,
        "run": loop_config(tmp_path).run.model_copy(update={"steps": 8})})
    whole = SavingRanks(1, [])
    history = _run(cfg, whole, FakeStore([pulled_group(i) for i in range(16)]), 8)
    assert [h["learning_rate"] for h in history] == pytest.approx(
        [cfg.learning_rate(s) for s in range(8)])
    # the same run stopped after step 4 (its checkpoint) and resumed by a new loop
    saved: list = []
    first = SavingRanks(1, saved)
    _run(cfg, first, FakeStore([pulled_group(i) for i in range(8)]), 4)
    second = SavingRanks(1, saved)
    _run(cfg, second, FakeStore([pulled_group(i) for i in range(8, 16)]), 4)
    assert _lrs(first) + _lrs(second) == pytest.approx(_lrs(whole))
    assert len(set(_lrs(whole))) == 7  # warmup, peak twice (end of warmup, decay start), decay
