"""`r3flow plan` checks that a job's checkpoint interval of delivered, not yet acked groups fits
its store's max_unacked_tokens (trainer/plan/store.py; issue 59), and that one group of its
longest trajectories fits the store's pull message limit (issue 54)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import UserError
from trainer.config import TrainerConfig
from trainer.plan.store import check_rayjob, plan_stores

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "k8s" / "qwen3-30b-a3b-grpo-r3.yaml"
ANN = {"r3flow.io/plan-seq-len": "8192", "r3flow.io/plan-model": "Qwen3-30B-A3B"}


def test_named_spec_fits_its_release_and_a_longer_cadence_is_refused(tmp_path: Path) -> None:
    [check] = plan_stores(SPEC)
    assert check.ok and check.interval_tokens == 20 * 64 * 8 * 8192
    assert "max_unacked_tokens 100,000,000 holds it" in check.describe("x")
    longer = tmp_path / "spec.yaml"
    longer.write_text(SPEC.read_text().replace("checkpoint_every: 20", "checkpoint_every: 40"))
    [check] = plan_stores(longer)
    assert not check.ok and "DOES NOT hold it" in check.describe("x")


def test_rendered_chart_reads_the_store_and_rollout_configs() -> None:
    cfg = TrainerConfig(data={"groups_per_step": 32}, run={"checkpoint_every": 5})
    docs = [{"kind": "ConfigMap", "data": {"rollout.yaml": "sampling:\n  n: 8\n"}},
            {"kind": "ConfigMap", "data": {"store.yaml": "max_unacked_tokens: 10000000\n"}}]
    check = check_rayjob(docs, cfg, ANN, "job")
    assert (check.group_size, check.unacked_limit) == (8, 10_000_000)
    assert not check.ok  # 5 x 32 x 8 x 8192 = 10.5M
    docs[1]["data"]["store.yaml"] = "max_unacked_tokens: null\n"
    assert not check_rayjob(docs, cfg, ANN, "job").ok  # unbounded: not planned


def test_every_named_spec_is_planned_and_fits() -> None:
    specs = [p for p in sorted((ROOT / "k8s").glob("*.yaml")) if "kind: RayJob" in p.read_text()]
    assert len(specs) >= 3
    for spec in specs:
        checks = plan_stores(spec)
        assert checks and all(c.ok for c in checks), spec


def test_named_spec_with_half_the_release_figures_is_refused_naming_the_other() -> None:
    assert check_rayjob([], TrainerConfig(), ANN, "job") is None  # neither: not planned
    half = {**ANN, "r3flow.io/plan-store-unacked-tokens": "1000"}
    with pytest.raises(UserError, match="r3flow.io/plan-group-size is missing"):
        check_rayjob([], TrainerConfig(), half, "job")


def test_one_group_of_the_longest_trajectories_must_fit_one_pull() -> None:
    """Qwen3-30B-A3B's worst case, 252.4 B per token: 8 x 128k is 252 MiB, within the store's
    default 512 MiB; 16 x 128k (505 MiB) too, 16 x 256k is not, and the plan names the value."""
    cfg = TrainerConfig(data={"groups_per_step": 4}, run={"checkpoint_every": 1})
    docs = [{"kind": "ConfigMap", "data": {"rollout.yaml": "sampling:\n  n: 8\n"}},
            {"kind": "ConfigMap", "data": {"store.yaml": "max_unacked_tokens: 100000000\n"}}]
    long = {**ANN, "r3flow.io/plan-seq-len": "131072"}
    check = check_rayjob(docs, cfg, long, "job")
    assert check.ok and check.pull_limit == 512 << 20
    assert check.group_bytes == 8 * 33_083_388
    assert "is up to 252.4 MiB in one Pull; max_pull_message_bytes 512 MiB holds it" in \
        check.describe("job")
    docs[0]["data"]["rollout.yaml"] = "sampling:\n  n: 16\n"
    longer = {**ANN, "r3flow.io/plan-seq-len": "262144"}
    check = check_rayjob(docs, cfg, longer, "job")
    assert check.unacked_ok and not check.pull_ok and not check.ok
    line = check.describe("job").splitlines()[-1]
    assert "1,009.6 MiB in one Pull; max_pull_message_bytes 512 MiB DOES NOT hold it" in line
    assert "raise store.config.max_pull_message_bytes" in line
    docs[1]["data"]["store.yaml"] += "max_pull_message_bytes: 1073741824\n"
    assert check_rayjob(docs, cfg, longer, "job").ok
