"""tests/bench/local_gpu_table.py: the per-step mismatch table of `r3flow local` run folders."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.local_gpu_table import markdown, run_figures


def _run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "local-1"
    (d / "trainer").mkdir(parents=True)
    (d / "rollout").mkdir()
    rows = [{"step": 1, "kind": "grpo", "time": 10.0, "logprob_diff_mean": 0.004,
             "logprob_diff_mean_off": 0.008, "mismatch_kl": 2e-5,
             "logprob_diff_far_share": 0.0, "tokens_per_second": 500.0,
             "weight_push_seconds": 1.5},
            {"step": 2, "kind": "grpo", "time": 12.0, "logprob_diff_mean": 0.002,
             "logprob_diff_mean_off": 0.004, "mismatch_kl": 4e-5,
             "logprob_diff_far_share": 0.01, "tokens_per_second": 9000.0,
             "weight_push_seconds": 1.0},
            {"kind": "sft", "step": 0}]  # not a GRPO step: left out
    (d / "trainer" / "train_log.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (d / "summary.json").write_text(json.dumps({"replay": "r3", "wall_seconds": 99.0}))
    (d / "rollout" / "rollout-0.summary.json").write_text(
        json.dumps({"generated_tokens": 300, "seconds": 10.0}))
    return d


def test_run_figures_and_table(tmp_path: Path):
    fig = run_figures(_run_dir(tmp_path))
    assert (fig["replay"], fig["steps"], fig["rollout_tokens_per_s"]) == ("r3", 2, 30.0)
    assert abs(fig["means"]["logprob_diff_mean"] - 0.003) < 1e-12
    assert fig["means_after_step1"]["tokens_per_second"] == 9000.0
    assert fig["means"]["mismatch_kl_off"] is None  # the r3 run's log has no off k3
    table = markdown(fig).splitlines()
    assert len(table) == 2 + 2 + 1  # header, rule, 2 steps, mean
    assert table[2].startswith("| 1 | 0.0040 | 0.0080 | 2.00e-05 | - |")
    assert "| 1.50 |" in table[2] and table[-1].startswith("| mean | 0.0030 | 0.0060 |")


def test_goal_lines_set_r3_against_off_and_split_the_r3_arm():
    from tests.bench.local_gpu_table import goal_lines

    def fig(k3, k3_off, far, far_off, diff):
        return {"means": {"logprob_diff_k3": k3, "logprob_diff_k3_off": k3_off,
                          "logprob_diff_far_share": far, "logprob_diff_far_share_off": far_off,
                          "logprob_diff_mean": diff}}

    lines = goal_lines({"fp8:r3": fig(1e-3, 4e-3, 0.01, 0.05, 0.02),
                        "fp8:off": fig(4e-3, None, 0.05, None, 0.04)})
    assert lines[0] == ("fp8:r3: same batches without replay / with: k3 4, >1 share 5; "
                        "numerics (with replay) k3 0.001, routing part 0.003")
    assert lines[1] == ("fp8: r3 / off k3 mismatch KL 0.25 (goal <= 0.5), >1 share 0.2 "
                        "(goal <= 0.2), |Δlp| 0.5")
    assert len(lines) == 2  # the off arm has no split of its own
