"""One local run: the same processes the Helm chart starts, on this machine.

Named steps: `prepare` (model, data, configs) -> `warm_start` (supervised, same trainer) ->
`start_services` (redis-server, store, rollout workers) -> `train` (GRPO through `r3flow train`,
weights pushed to the workers after every step) -> `finish` (stop workers, account for every
trajectory, write summary and report).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from services.common.net import free_port
from services.local import family, report
from services.local.accounting import Accounting
from services.local.budget import OUT_OF_BUDGET_EXIT, Budget, OutOfBudget, Stalled
from services.local.config import (
    LocalConfig,
    resolved,
    rollout_concurrency,
    rollout_config,
    seeded,
    store_config,
    trainer_config,
    warm_start_config,
)
from services.local.monitor import RunMonitor, StallWatch, StoreFacts
from services.local.procs import ChildDied, Supervisor, tail
from services.rollout.shutdown import SHUTDOWN_S

if TYPE_CHECKING:
    from services.store.redis_server import EmbeddedRedis

log = logging.getLogger(__name__)

CHILD_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
             "VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
             "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
             "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}

# One OpenMP thread for the warm start, as the trainer's Ray rank has (trainer.ranks.ray_launch): with
# torch's default of one per core, a 2-core box busy with other work made each SFT step wait on
# a descheduled sibling thread: 25 s a step at load 20 against 1.5 s alone (issue 46).
WARM_START_ENV = {"OMP_NUM_THREADS": "1"}

# In-flight groups a stopping worker may still finish and send: a group of the tiny model takes
# about a second; at the end of a run the trainer is gone and no group can be sent, so every
# second of it is waited out (20 s did, in every local run).
ROLLOUT_STOP_GRACE_S = 5.0
TRAINER_STOP_GRACE_S = 15.0  # SIGTERM -> the trainer ends after its current step (pass)


def new_run_dir(runs_dir: str) -> Path:
    """A fresh folder per run, so a second run never trips over the first one's leftovers."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(runs_dir) / f"local-{stamp}-{os.getpid()}"
    path.mkdir(parents=True)
    return path


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path


class LocalRun:
    """Owns the run folder, the children and the report of one `r3flow local`."""

    def __init__(self, cfg: LocalConfig) -> None:
        self.cfg = cfg
        # what the run's children get (the sections over the preset; paths aside)
        self.store_cfg, self.rollout_cfg, self.trainer_cfg = (
            resolved(cfg, name) for name in ("store", "rollout", "trainer"))
        # boot: the family's backend (a refused megatron fails here, before any folder or child)
        self.plan = family.plan(cfg.family, cfg.trainer_backend, seeded(cfg)[1])
        family.log_plan(self.plan, self.trainer_cfg.model.dtype)
        self.dir = new_run_dir(cfg.runs_dir)
        self.sup = Supervisor(self.dir / "logs", env=CHILD_ENV)
        self.redis: EmbeddedRedis | None = None
        self.store_addr = ""
        self.monitor = RunMonitor(cfg, self.dir)
        self.started = time.monotonic()
        self.budget = Budget.of(cfg)
        self.stalls = StallWatch(self.store_facts)
        self.stops: dict[str, dict] = {}  # child -> how its stop went (stop_child)
        tqdm.write(f"budget: {self.budget.total():.0f} s for {self.trainer_cfg.run.steps} GRPO steps "
                   f"({self.budget.describe()}); a run past it stops, reports the steps done "
                   f"and exits {OUT_OF_BUDGET_EXIT}")

    # ------------------------------------------------------------------ steps
    def prepare(self) -> Path:
        from services.local.tasks import write_datasets

        write_json(self.dir / "config.json", self.cfg.model_dump(mode="json"))
        write_json(self.dir / "family.json", dataclasses.asdict(self.plan))
        task, model = seeded(self.cfg)
        write_datasets(task, self.dir / "data")
        return family.build_model(self.dir / "model-init", self.cfg.family, model)

    def warm_start(self, init_dir: Path) -> Path:
        out = self.dir / "model-warm"
        if self.cfg.warm_start_steps == 0:
            return init_dir
        conf = write_json(self.dir / "configs" / "warm_start.json",
                          warm_start_config(self.cfg, self.dir, init_dir, out, self.plan))
        argv = [sys.executable, "-m", "services.local.warm_start", "--config", str(conf)]
        log_path = self.dir / "logs" / "warm_start.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        bar = tqdm(total=self.cfg.warm_start_steps, desc="warm start (SFT)", unit="step")
        with log_path.open("w") as err:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env={**os.environ, **CHILD_ENV, **WARM_START_ENV},
                                    start_new_session=True)
            for line in proc.stdout:  # type: ignore[union-attr]
                if line.startswith("{"):
                    rec = json.loads(line)
                    if rec.get("kind") == "sft":
                        bar.update(1)
                        bar.set_postfix(loss=f"{rec['loss']:.3f}")
        bar.close()
        if proc.wait() != 0:
            raise RuntimeError("warm start failed:\n" + tail(log_path))
        return out

    def start_services(self, model_dir: Path) -> None:
        from services.store.client import StoreClient
        from services.store.redis_server import EmbeddedRedis

        self.redis = EmbeddedRedis(self.dir / "redis").start()
        port, mport = free_port(), free_port()
        self.store_addr = f"127.0.0.1:{port}"
        conf = write_json(self.dir / "configs" / "store.json", store_config(self.cfg, self.dir))
        self.sup.start("store", ["store", "--config", str(conf), "--listen", self.store_addr,
                                 "--metrics-port", str(mport), "--redis-url", self.redis.url],
                       persistent=True)
        self.monitor.add("store", mport)
        with StoreClient(self.store_addr, timeout_s=5, max_retries=2) as client:
            client.wait_ready(60)
        for w in range(self.cfg.workers):
            self._start_rollout(model_dir, w)

    def _start_rollout(self, model_dir: Path, w: int) -> None:
        mport = free_port()
        conf = write_json(self.dir / "configs" / f"rollout-{w}.json",
                          rollout_config(self.cfg, self.dir, model_dir, w, self.plan))
        self.sup.start(f"rollout-{w}", [
            "rollout", "--config", str(conf), "--store", self.store_addr, "--metrics-port",
            str(mport), "--summary-file", str(self.summary_path(f"rollout-{w}")),
            "--stop-grace-s", str(ROLLOUT_STOP_GRACE_S)])
        self.monitor.add(f"rollout-{w}", mport)

    def summary_path(self, worker: str, incarnation: int = 0) -> Path:
        """The summary a rollout worker keeps current (earlier incarnations: 1, 2, ...)."""
        suffix = f".{incarnation}" if incarnation else ""
        return self.dir / "rollout" / f"{worker}.summary{suffix}.json"

    def restart_child(self, name: str, extra_args: tuple[str, ...] = ()):  # noqa: ANN201
        """Start a dead child (a procs.Child) again with the same command and config, plus
        `extra_args`; a rollout worker's last summary is kept under the next free incarnation
        number first."""
        child = self.child(name)
        child.argv += list(extra_args)
        current = self.summary_path(name)
        if current.is_file():
            n = 1
            while self.summary_path(name, n).exists():
                n += 1
            current.rename(self.summary_path(name, n))
        return self.sup.restart(child)

    def child(self, name: str):  # noqa: ANN201 (a procs.Child)
        return next(c for c in self.sup.children if c.name == name)

    def worker_summaries(self) -> list[dict]:
        """Every rollout worker incarnation's last summary (final, or progress before a kill)."""
        return [json.loads(p.read_text())
                for p in sorted((self.dir / "rollout").glob("*.summary*.json"))]

    def start_trainer(self, model_dir: Path):  # noqa: ANN201 (a procs.Child)
        mport = free_port()
        conf = write_json(self.dir / "configs" / "trainer.json",
                          trainer_config(self.cfg, self.dir, model_dir, self.plan))
        trainer = self.sup.start("trainer", ["train", "--config", str(conf), "--store",
                                             self.store_addr, "--metrics-port", str(mport)])
        self.monitor.add("trainer", mport)
        return trainer

    def train(self, model_dir: Path) -> list[dict]:
        trainer = self.start_trainer(model_dir)
        self.monitor.start_prometheus()
        self.print_endpoints()
        return self._follow(trainer)

    def _follow(self, trainer) -> list[dict]:
        """Print a table row per step as the trainer logs it; wait for the trainer to exit."""
        log_path = self.dir / "trainer" / "train_log.jsonl"
        steps = self.trainer_cfg.run.steps
        bar = tqdm(total=steps, desc=f"GRPO ({self.trainer_cfg.replay.mode})", unit="step")
        tqdm.write(report.table_header())
        seen: list[dict] = []
        while trainer.alive() and not self.budget.over(time.monotonic() - self.started):
            self.sup.check()
            rows = report.read_log(log_path)
            for rec in rows[len(seen):]:
                tqdm.write(report.table_row(rec))
                bar.update(1)
            seen = rows
            line = self.budget.update([r["time"] for r in rows], time.monotonic() - self.started)
            if line:
                tqdm.write(line)
            self.check_stall([r["time"] for r in rows])
            if rows and self.monitor.snapshot_due():
                self.monitor.snapshot()
            if rows and self.monitor.alert_fired():
                self.monitor.snapshot()
                self.stop_child(trainer, TRAINER_STOP_GRACE_S)
                break
            time.sleep(0.5)
        bar.close()
        if trainer.alive():
            raise OutOfBudget(self.budget, len(report.read_log(log_path)))
        if trainer.proc.returncode != 0:
            raise ChildDied("trainer", trainer.proc.returncode, trainer.log_path, 30)
        rows = report.read_log(log_path)
        for rec in rows[len(seen):]:
            tqdm.write(report.table_row(rec))
        return rows

    def check_stall(self, step_times: list[float]) -> None:
        """Stalled (one line: the component and the cause) once no step came for
        STALL_FACTOR x the recent step time, instead of waiting out the budget."""
        idle = self.stalls.idle(step_times, time.monotonic())
        if idle is not None:
            component, cause = self.stalls.cause(self.dead_rollouts())
            raise Stalled(self.budget, len(step_times), component, cause, idle)

    def store_facts(self) -> StoreFacts:
        from services.store.client import StoreClient

        with StoreClient(self.store_addr, timeout_s=5, max_retries=2) as client:
            stats, workers = client.stats(), client.list_workers()
        return StoreFacts.read(stats, workers, self.monitor.text("store"))

    def dead_rollouts(self) -> dict[str, str]:
        """Rollout worker -> why it is no use: exited, or its engine reported dead."""
        dead = {}
        for c in self.sup.children:
            if not c.name.startswith("rollout"):
                continue
            if not c.alive():
                rc = None if c.proc is None else c.proc.returncode
                dead[c.name] = f"rollout worker exited with code {rc}"
            elif self.monitor.unhealthy(c.name):
                dead[c.name] = "engine dead (its /health reports it; see its log)"
        return dead

    def print_endpoints(self) -> None:
        tqdm.write(f"store gRPC on {self.store_addr} (loopback, no TLS: local mode)")
        self.monitor.print_endpoints()

    def stop_rollouts(self) -> None:
        """SIGTERM every worker: it finishes or abandons its groups and writes its summary."""
        for child in self.sup.children:
            if child.name.startswith("rollout"):
                self.stop_child(child, ROLLOUT_STOP_GRACE_S + SHUTDOWN_S + 5)

    def stop_child(self, child, grace_s: float) -> None:  # noqa: ANN001 (a procs.Child)
        """Stop a child within `grace_s` (then SIGKILL); how it went goes to `stops`."""
        if not child.alive():
            return
        seconds, killed = self.sup.stop(child, timeout_s=grace_s)
        self.stops[child.name] = {"seconds": round(seconds, 2), "grace_s": grace_s,
                                  "killed": killed}

    def out_of_budget(self, over: OutOfBudget) -> dict:
        """The budget ran out: stop the workers, then the trainer (SIGTERM: it ends after its
        current pass and checkpoints), within their grace; account for every trajectory and
        write the summary and report of the steps done, with the failure named."""
        self.monitor.snapshot()
        # the trainer first: it ends after its current step (no push: the workers go next)
        for child in self.sup.children:
            if child.name == "trainer":
                self.stop_child(child, TRAINER_STOP_GRACE_S)
        self.stop_rollouts()
        try:
            trajectories = self._account().as_dict()
        except Exception as e:  # noqa: BLE001 (a failure report must not fail)
            trajectories = {"unavailable": f"{type(e).__name__}: {e}"}
        rows = report.read_log(self.dir / "trainer" / "train_log.jsonl")
        failure = {"budget_s": round(over.budget.deadline(), 1), "budget": over.budget.describe(),
                   "step": len(rows), "steps": over.steps, "message": over.message(len(rows))}
        if isinstance(over, Stalled):
            failure["stalled"] = {"component": over.component, "cause": over.cause,
                                  "idle_s": round(over.idle_s, 1)}
        summary = self._summary(rows, trajectories, out_of_budget=failure,
                                prometheus=self.monitor.report())
        report.plot_report(rows, self.dir / "report.png", f"r3flow local — replay="
                           f"{self.trainer_cfg.replay.mode}, {len(rows)} of {over.steps} GRPO "
                           f"steps ({'stalled' if isinstance(over, Stalled) else 'out of budget'})")
        return summary

    def finish(self, rows: list[dict]) -> dict:
        """Stop the workers, account for every trajectory, write summary + report."""
        self.monitor.snapshot()
        self.stop_rollouts()
        summary = self._summary(rows, self._account().as_dict(),
                                prometheus=self.monitor.report())
        report.plot_report(rows, self.dir / "report.png",
                           f"r3flow local — replay={self.trainer_cfg.replay.mode}, {len(rows)} GRPO steps")
        return summary

    def abort(self, died: ChildDied) -> dict:
        """A child died: stop the others by pid (workers first, so they report their groups,
        then the trainer), account for what the store holds while it still runs, and write
        summary.json naming the child that died."""
        self.monitor.snapshot()
        self.stop_rollouts()
        for child in self.sup.children:
            if child.name == "trainer":
                self.stop_child(child, TRAINER_STOP_GRACE_S)
        try:
            trajectories = self._account().as_dict()
        except Exception as e:  # noqa: BLE001 (the store itself may be what died)
            trajectories = {"unavailable": f"{type(e).__name__}: {e}"}
        rows = report.read_log(self.dir / "trainer" / "train_log.jsonl")
        failure = {"child": died.name, "exit_code": died.returncode, "cause": died.cause,
                   "log_tail": died.log_tail}
        return self._summary(rows, trajectories, failure=failure)

    def _account(self) -> Accounting:
        in_flight = self.cfg.workers * rollout_concurrency(self.cfg)
        return Accounting.collect(self.store_addr, self.worker_summaries(),
                                  self.rollout_cfg.sampling.n, in_flight)

    def _summary(self, rows: list[dict], trajectories: dict, **extra: object) -> dict:
        summary = {"run_dir": str(self.dir), "replay": self.trainer_cfg.replay.mode.value,
                   "steps": len(rows), "max_policy_lag": self.store_cfg.max_policy_lag,
                   "measure_every": self.trainer_cfg.replay.compare_off_every,
                   "budget_s": round(self.budget.total(), 1), "stops": self.stops,
                   "wall_seconds": round(time.monotonic() - self.started, 1),
                   **report.summarize(rows), "trajectories": trajectories,
                   "stopped_by_alert": self.monitor.stopped_by_alert, **extra}
        write_json(self.dir / "summary.json", summary)
        return summary

    def close(self) -> None:
        self.monitor.stop()
        self.stop_rollouts()  # within their own stop bound (stop_all gives each child 15 s)
        self.sup.stop_all()
        if self.redis is not None:
            self.redis.stop()
