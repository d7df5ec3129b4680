"""`r3flow local --compare`: per-arm summary figures and the overlay report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from services.local import compare
from services.local.cli import _arms


def _rows(diff: float, kls: list[float]) -> list[dict]:
    return [{"step": i + 1, "reward_mean": 0.1 * i, "ppo_kl": kl, "clip_ratio": 0.01,
             "logprob_diff_mean": diff, "routing_agreement": 0.9} for i, kl in enumerate(kls)]


def test_percentile_interpolates_and_ignores_nan() -> None:
    assert compare.percentile([1.0, 2.0, 3.0, 4.0, math.nan], 0.5) == 2.5
    assert compare.percentile([5.0], 0.99) == 5.0
    assert math.isnan(compare.percentile([], 0.5))


def test_spikes_are_counted_against_the_running_median() -> None:
    flat = [1e-3] * 10
    assert compare.count_spikes(flat) == 0
    assert compare.count_spikes(flat[:5] + [1e-2] + flat[5:]) == 1
    assert compare.count_spikes([1e-5, 1e-4]) == 0  # 10x, but under the floor


def test_comparison_writes_summary_per_arm_with_ratio_to_off(tmp_path: Path) -> None:
    arms = {"r3": _rows(1e-3, [1e-4] * 6), "off": _rows(4e-3, [1e-4] * 5 + [5e-3])}
    data = compare.write_comparison(tmp_path, arms)
    by_arm = {s["arm"]: s for s in data["arms"]}
    assert by_arm["r3"]["logprob_diff_ratio_vs_off"] == pytest.approx(0.25)
    assert by_arm["off"]["ppo_kl_spikes"] == 1 and by_arm["r3"]["ppo_kl_spikes"] == 0
    assert json.loads((tmp_path / "compare.json").read_text()) == data
    assert (tmp_path / "compare.png").stat().st_size > 10_000
    assert "(0.25 x off)" in compare.summary_line(by_arm["r3"])


def test_compare_flag_names_bad_arms() -> None:
    assert _arms("off,r2") == ["off", "r2"]
    with pytest.raises(Exception, match="--compare"):
        _arms("r4")


def test_summary_line_has_stale_share_and_wall_from_the_run_summary(tmp_path: Path) -> None:
    rows = _rows(2e-3, [1e-3, 2e-3, 3e-3])
    for r in rows:
        r["logprob_diff_mean_off"] = 4e-3
    run = {"wall_seconds": 321.0, "trajectories": {"produced": 1000, "dropped": {"stale": 53}}}
    s = compare.arm_summary("r3", rows, None, run)
    assert s["stale_fraction"] == pytest.approx(0.053) and s["wall_seconds"] == 321.0
    assert s["ppo_kl_mean"] == pytest.approx(2e-3)
    assert s["logprob_diff_mean_same_batch_off"] == pytest.approx(4e-3)
    line = compare.summary_line(s)
    assert "stale 5.3%" in line and "321 s" in line and "ppo_kl mean 2.00e-03" in line


def test_step_one_mismatch_is_reported_against_the_off_arm() -> None:
    r3, off = _rows(1e-3, [1e-4] * 3), _rows(4e-3, [1e-4] * 3)
    r3[0]["logprob_diff_mean"], off[0]["logprob_diff_mean"] = 2e-3, 3e-3
    s = compare.arm_summary("r3", r3, off)
    assert s["logprob_diff_step1"] == 2e-3
    assert s["logprob_diff_step1_ratio_vs_off"] == pytest.approx(2 / 3)
    assert "step 1 2.000e-03 (0.67 x off)" in compare.summary_line(s)


def test_arms_combine_replay_and_rollout_correction() -> None:
    from services.local.cli import arm_config
    from services.local.config import CORRECTIONS, LocalConfig, trainer_config
    from trainer.config import TrainerConfig

    assert _arms("off,tis,r3,r3+tis") == ["off", "tis", "r3", "r3+tis"]
    for bad in ("tis+r3", "r3+", "r3+tis+mis"):
        with pytest.raises(Exception, match="--compare"):
            _arms(bad)
    cfg = LocalConfig()
    tis = trainer_config(arm_config(cfg, "tis", "x"), Path("run"), Path("model"))
    assert tis["replay"]["mode"] == "off" and tis["data"]["old_logprobs"] == "trainer"
    assert tis["loss"]["rollout_correction"]["is_level"] == "token"
    both = arm_config(cfg, "r3+tis", "x")
    assert (both.trainer["replay"]["mode"], both.trainer["loss"]["rollout_correction"]) == (
        "r3", CORRECTIONS["tis"])
    off = trainer_config(arm_config(both, "off", "x"), Path("run"), Path("model"))
    assert off["data"]["old_logprobs"] == "trainer"  # the base config's (both's), kept
    assert TrainerConfig.model_validate(off).loss.rollout_correction.enabled is False
    assert off["loss"]["kl_metric"] is True  # make run measures kl_ref


def test_comparison_reports_is_weights_and_fresh_diff(tmp_path: Path) -> None:
    rows = _rows(2e-3, [1e-3, 2e-3])
    for r in rows:
        r |= {"is_weight_mean": 1.01, "is_weight_max": 3.5, "is_truncated_share": 0.02,
              "mismatch_kl": 4e-4, "logprob_diff_mean_fresh": 1e-3}
    s = compare.write_comparison(tmp_path, {"tis": rows})["arms"][0]
    assert s["is_weight_max"] == 3.5 and s["logprob_diff_mean_fresh"] == pytest.approx(1e-3)
    line = compare.summary_line(s)
    assert "IS weight mean 1.010 max 3.50 truncated 2.00%" in line and "fresh 1.000e-03" in line
