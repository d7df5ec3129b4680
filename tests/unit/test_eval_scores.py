"""Held-out eval figures (services.rollout.evaluation): the unbiased pass@k estimator, a set's
accuracy and pass@k, and the eval section's validation."""

from __future__ import annotations

import math

import pytest

from services.common.config import ConfigError, build_config
from services.rollout.config import RolloutConfig
from services.rollout.evaluation import pass_at_k, set_scores


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0 and pass_at_k(4, 4, 1) == 1.0


def test_set_scores_average_over_prompts() -> None:
    got = set_scores([True, False, False, True], [2, 0, 1, 4], n=4, ks=[1, 4])
    assert got == {"prompts": 4, "accuracy": 0.5,
                   "pass_at_k": {"1": pytest.approx((0.5 + 0 + 0.25 + 1) / 4),
                                 "4": pytest.approx(3 / 4)}}
    assert set_scores([True], [0], n=0, ks=[1]) == {"prompts": 1, "accuracy": 1.0}


def _cfg(ev: dict) -> RolloutConfig:
    return build_config(RolloutConfig, {"engine": {"model": "m"}, "dataset": "d.jsonl",
                                        "eval": ev})


@pytest.mark.parametrize(("ev", "says"), [
    ({"sets": []}, r"eval\.sets"),
    ({"sets": [{"name": "a b", "dataset": "x"}]}, r"eval\.sets\.0\.name"),
    ({"sets": [{"name": "a", "dataset": "x"}], "samples": 2, "k": [4]}, r"k: \[4\] outside"),
    ({"sets": [{"name": "a", "dataset": "x"}] * 2}, r"names must be unique")])
def test_a_bad_eval_section_names_its_field(ev, says) -> None:
    with pytest.raises(ConfigError, match=says):
        _cfg(ev)


def test_eval_defaults() -> None:
    ev = _cfg({"sets": [{"name": "gsm8k", "dataset": "x"}]}).eval
    assert ev is not None and (ev.every_versions, ev.samples, ev.k, ev.only) == (1, 4, [1], False)


def test_only_the_named_shard_scores() -> None:
    ev = {"sets": [{"name": "a", "dataset": "x"}]}
    cfg = build_config(RolloutConfig, {"engine": {"model": "m"}, "dataset": "d.jsonl",
                                       "num_shards": 4, "worker_id": "r-2", "eval": ev})
    assert cfg.eval is not None and cfg.shard_index == 2
    assert not cfg.eval.runs_on(cfg.shard_index) and cfg.eval.runs_on(0)
    every = cfg.eval.model_copy(update={"on_shard": None})
    assert all(every.runs_on(s) for s in range(4))
