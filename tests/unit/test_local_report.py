"""r3flow local's summary of tracking and held-out evals (services.local.report.tracking): the
first and last score of each set, the TensorBoard folder, printed by the CLI."""

from __future__ import annotations

import json

from services.local.cli import print_summary
from services.local.report import table_header, table_row, tracking


def test_tracking_names_the_first_and_last_score_of_each_set(tmp_path) -> None:
    rows = [{"policy_version": v, "source": src, "accuracy": a, "pass_at_k": {"1": a / 2}}
            for v, src, a in ((0, "add", 0.1), (0, "mul", 0.0), (10, "add", 0.3),
                              (20, "add", 0.5))]
    (tmp_path / "eval_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "trainer" / "tensorboard").mkdir(parents=True)
    (tmp_path / "trainer" / "tensorboard" / "events.out.tfevents.1.h").write_bytes(b"")
    got = tracking(tmp_path)
    assert got["eval"] == {
        "add": {"start": {"policy_version": 0, "accuracy": 0.1, "pass_at_k": {"1": 0.05}},
                "end": {"policy_version": 20, "accuracy": 0.5, "pass_at_k": {"1": 0.25}},
                "scores": 3},
        "mul": {"start": {"policy_version": 0, "accuracy": 0.0, "pass_at_k": {"1": 0.0}},
                "end": {"policy_version": 0, "accuracy": 0.0, "pass_at_k": {"1": 0.0}},
                "scores": 1}}
    assert got["tensorboard_files"] == 1
    assert tracking(tmp_path / "none")["eval"] == {}


def test_the_summary_prints_eval_start_and_end_and_the_tensorboard_folder(tmp_path,
                                                                          capsys) -> None:
    (tmp_path / "eval_log.jsonl").write_text(
        json.dumps({"policy_version": 0, "source": "add", "accuracy": 0.125,
                    "pass_at_k": {"1": 0.1, "4": 0.3}}) + "\n"
        + json.dumps({"policy_version": 40, "source": "add", "accuracy": 0.5,
                      "pass_at_k": {"1": 0.4, "4": 0.7}}) + "\n")
    t = {"produced": 8, "trained": 8, "dropped": {}, "unused_at_end": 0, "leased_at_stop": 0,
         "in_incomplete_groups": 0, "balanced": True}
    s = {"run_dir": str(tmp_path), "wall_seconds": 1.0, "steps": 40, "replay": "r3",
         "reward_first5": 0.1, "reward_last5": 0.2, "reward_gain": 0.1,
         "logprob_diff_mean_off": 0.0, "logprob_diff_ratio_vs_off": None,
         "logprob_diff_mean": 0.0, "routing_agreement": 0.9, "trajectories": t,
         **tracking(tmp_path)}
    print_summary(s)
    out = capsys.readouterr().out
    assert "add: greedy accuracy 0.125 at v0 -> 0.5 at v40, pass@k @1 0.1, @4 0.3 -> " \
        "@1 0.4, @4 0.7 (2 scores" in out
    assert f"tensorboard --logdir {tmp_path}/trainer/tensorboard" in out
    assert "acc" in table_header() and " 0.75" in table_row({"step": 1, "accuracy": 0.75})
