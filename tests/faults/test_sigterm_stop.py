"""Pod termination of every process kind the chart and `r3flow local` start: SIGTERM to the
process only (as kubelet sends it to a container's main process), timed, in one local run.

Kinds, in the order a run stops them: the rollout worker (with its vLLM engine processes, which
kubelet never signals: the worker stops them), the trainer (`r3flow train`, the Ray driver with
its private Ray), Prometheus (local only), the store, redis-server. Each must exit with code 0
within its bound, and leave nothing of its process group behind; each bound is at most half of
the chart's terminationGracePeriodSeconds for that pod (redis: Kubernetes' default 30 s).
The rollout worker stops mid-generation: no new prompt, in-flight groups finished or abandoned,
a final summary; the store holds every group the summary calls sent.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from services.common.tiny_moe import TinyMoeConfig
from services.local.config import LocalConfig
from services.local.procs import wait_for
from services.local.run import LocalRun
from services.store.client import StoreClient

pytestmark = [pytest.mark.faults]

REPO = Path(__file__).resolve().parents[2]
# kind -> (its bound in s, the chart value that is its pod's grace period)
# the rollout worker's own deadline is ROLLOUT_STOP_GRACE_S + SHUTDOWN_S (then exit code 4)
BOUNDS = {"rollout": (60.0, "rollout"),
          "trainer": (60.0, "trainer"), "prometheus": (15.0, None),
          "store": (15.0, "store"), "redis": (10.0, "redis")}
K8S_DEFAULT_GRACE_S = 30
STOP_LINES = ("rollout done", "force killing", "exits with code", "overran")
LEFTOVER_S = 10.0  # after the main process: its helpers (resource tracker, Ray daemons)


def chart_grace_s(component: str | None) -> float | None:
    """The chart's terminationGracePeriodSeconds of `component`'s pod (Kubernetes' default when
    the chart sets none); None for a process the chart does not run."""
    if component is None:
        return None
    values = yaml.safe_load((REPO / "helm/r3flow/values.yaml").read_text())
    return float(values[component].get("terminationGracePeriodSeconds", K8S_DEFAULT_GRACE_S))


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry.name))
    return out


def sigterm_and_time(kind: str, proc: subprocess.Popen, pgid: int | None,
                     timings: dict[str, float]) -> None:
    """SIGTERM to `proc` alone; its exit code must be 0 and it (and its process group) gone
    within the kind's bound."""
    bound_s, component = BOUNDS[kind]
    grace = chart_grace_s(component)
    assert grace is None or bound_s <= grace / 2, (kind, bound_s, grace)
    t0 = time.monotonic()
    print(f"SIGTERM to {kind} (pid {proc.pid}) at {time.strftime('%H:%M:%S')}", flush=True)
    os.kill(proc.pid, signal.SIGTERM)
    try:
        rc = proc.wait(timeout=bound_s)
    finally:
        timings[kind] = round(time.monotonic() - t0, 2)
        print(f"SIGTERM -> exit: {kind} {timings[kind]:.2f}s (bound {bound_s:.0f}s, chart "
              f"grace {grace}s)", flush=True)
    assert rc == 0, (kind, rc)
    if pgid is not None:  # what it started (engine, Ray) ends with it
        wait_for(lambda: not group_members(pgid), LEFTOVER_S, f"{kind}'s processes to exit")


def test_every_process_kind_stops_on_sigterm_within_its_bound():
    runs = Path(tempfile.mkdtemp(prefix="r3flow-stop-"))
    run = LocalRun(LocalConfig(runs_dir=str(runs), warm_start_steps=0, model=TinyMoeConfig(),
                               rollout={"sampling": {"n": 4, "max_tokens": 6}},
                               trainer={"run": {"steps": 100_000},
                                        "data": {"groups_per_step": 2},
                                        "replay": {"compare_off": False}}))
    timings: dict[str, float] = {}
    try:
        model_dir = run.prepare()
        run.start_services(model_dir)
        trainer = run.start_trainer(model_dir)
        run.monitor.start_prometheus()
        summary_path = run.summary_path("rollout-0")
        train_log = run.dir / "trainer" / "train_log.jsonl"

        def mid_run() -> bool:
            s = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
            return (s.get("groups_ok", 0) >= 2 and s.get("groups_in_flight", 0) > 0
                    and train_log.is_file() and bool(train_log.read_text().strip()))

        wait_for(mid_run, 600, "a trainer step while rollout-0 generates", supervisor=run.sup)
        worker = run.child("rollout-0")
        sigterm_and_time("rollout", worker.proc, worker.pid, timings)
        print("\n".join(line for line in worker.log_path.read_text().splitlines()
                        if any(k in line for k in STOP_LINES)), flush=True)
        s = json.loads(summary_path.read_text())
        with StoreClient(run.store_addr, timeout_s=10) as client:
            complete = client.stats().trajectories_complete
        sigterm_and_time("trainer", trainer.proc, trainer.pid, timings)
        if run.monitor.prom is not None:
            sigterm_and_time("prometheus", run.monitor.prom.proc, None, timings)
        store = run.child("store")
        sigterm_and_time("store", store.proc, store.pid, timings)
        assert run.redis is not None and run.redis.proc is not None
        sigterm_and_time("redis", run.redis.proc, None, timings)
    finally:
        print(f"SIGTERM -> exit seconds per kind: {timings}", flush=True)
        run.close()
    assert s["final"] and s["stopped_early"], s
    assert s["groups_in_flight"] == 0, s
    assert s["groups_started"] == s["groups_ok"] + s["groups_failed"] + s["groups_abandoned"], s
    assert s["trajectories_sent"] == 4 * s["groups_ok"] and s["trajectories_sent"] <= complete
    assert complete <= s["trajectories_sent"] + s["trajectories_abandoned"], (complete, s)
    shutil.rmtree(runs)
