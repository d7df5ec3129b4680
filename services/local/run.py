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
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from services.common.net import free_port
from services.local import family, report
from services.local.accounting import Accounting
from services.local.config import (
    LocalConfig,
    rollout_concurrency,
    rollout_config,
    seeded,
    store_config,
    trainer_config,
    warm_start_config,
)
from services.local.procs import ChildDied, Supervisor, tail
from services.rollout.shutdown import SHUTDOWN_S

if TYPE_CHECKING:
    from services.local.prom import LocalPrometheus
    from services.store.redis_server import EmbeddedRedis

log = logging.getLogger(__name__)

CHILD_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
             "VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
             "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
             "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}

# One OpenMP thread for the warm start, as the trainer's Ray rank has (trainer.ray_launch): with
# torch's default of one per core, a 2-core box busy with other work made each SFT step wait on
# a descheduled sibling thread: 25 s a step at load 20 against 1.5 s alone (issue 46).
WARM_START_ENV = {"OMP_NUM_THREADS": "1"}

# In-flight groups a stopping worker may still finish and send: a group of the tiny model takes
# about a second; at the end of a run the trainer is gone and no group can be sent, so every
# second of it is waited out (20 s did, in every local run).
ROLLOUT_STOP_GRACE_S = 5.0
TRAINER_STOP_GRACE_S = 15.0  # SIGTERM -> the trainer ends after its current step (pass)
OUT_OF_BUDGET_EXIT = 124  # the exit code of a run past its budget (as timeout(1))


# After this many steps the measured rate is checked: a per-step allowance that `RATE_MARGIN`
# x the measured seconds a step would overrun is raised to that (a slow box is not a failure;
# a run that stopped stepping still is).
MEASURED_AFTER_STEPS = 5
RATE_MARGIN = 2.0


class OutOfBudget(RuntimeError):
    """The run outlived its budget (Budget) before its last step."""

    def __init__(self, budget: Budget, step: int) -> None:
        self.budget, self.step, self.steps = budget, step, budget.steps
        super().__init__(self.message(step))

    def message(self, step: int) -> str:
        """The one line: the budget, what it was made of, and the step the run reached."""
        return (f"budget of {self.budget.deadline():.0f} s ({self.budget.describe()}) ran out "
                f"at GRPO step {step} of {self.steps}")


@dataclasses.dataclass
class Budget:
    """The run's time budget in seconds from its start: `fixed` (timeout_s), or `boot_s` to
    the first GRPO step plus `step_s` for each step after it; `step_s` follows the measured
    rate (raised to RATE_MARGIN x the median step) once MEASURED_AFTER_STEPS steps are in."""

    steps: int
    boot_s: float
    step_s: float
    follows_rate: bool
    fixed: float | None = None
    first_step_at: float | None = None  # seconds from the run's start
    measured_s: float | None = None  # the median step, once measured

    @classmethod
    def of(cls, cfg: LocalConfig) -> Budget:
        return cls(cfg.grpo.steps, cfg.budget_boot_s, cfg.budget_step_s,
                   cfg.budget_follows_rate, cfg.timeout_s)

    def total(self) -> float:
        """Seconds from the run's start the whole run may take, as far as known now."""
        if self.fixed is not None:
            return self.fixed
        start = self.boot_s if self.first_step_at is None else self.first_step_at
        return start + (self.steps - 1) * self.step_s

    def deadline(self) -> float:
        """Seconds from the run's start by which the next thing must have happened: the first
        step (within boot_s), then the last."""
        if self.fixed is None and self.first_step_at is None:
            return self.boot_s
        return self.total()

    def describe(self) -> str:
        if self.fixed is not None:
            return "timeout_s"
        start = (f"{self.boot_s:.0f} s to the first step" if self.first_step_at is None
                 else f"first step at {self.first_step_at:.0f} s")
        return (f"{start} + {self.steps - 1} more x "
                f"{self.step_s:.3g} s" + (f" (2x the measured {self.measured_s:.1f} s a step)"
                                          if self.measured_s and self.follows_rate
                                          and self.step_s == RATE_MARGIN * self.measured_s
                                          else ""))

    def over(self, elapsed: float) -> bool:
        return elapsed > self.deadline()

    def update(self, step_times: list[float], elapsed: float) -> str | None:
        """With the steps logged so far (their wall times): start the step clock at the first,
        and once MEASURED_AFTER_STEPS more are in, measure the rate; a line to print, or None."""
        if step_times and self.first_step_at is None:
            self.first_step_at = elapsed
        if self.measured_s is not None or len(step_times) < MEASURED_AFTER_STEPS + 1:
            return None
        gaps = sorted(b - a for a, b in zip(step_times, step_times[1:], strict=False))
        self.measured_s = gaps[len(gaps) // 2]  # median; step 1 (boot, empty store) left out
        left = self.steps - len(step_times)
        line = (f"budget: {self.measured_s:.1f} s a step measured over steps 2-"
                f"{len(step_times)}: the {self.steps} steps end in ~"
                f"{elapsed + left * self.measured_s:.0f} s")
        if self.fixed is None and self.follows_rate and RATE_MARGIN * self.measured_s > self.step_s:
            self.step_s = RATE_MARGIN * self.measured_s
            line += f"; per-step allowance raised to {self.step_s:.1f} s"
        return line + f" (budget {self.total():.0f} s)"


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
        # boot: the family's backend (a refused megatron fails here, before any folder or child)
        self.plan = family.plan(cfg.family, cfg.trainer_backend, seeded(cfg)[1])
        family.log_plan(self.plan, cfg.grpo.dtype)
        self.dir = new_run_dir(cfg.runs_dir)
        self.sup = Supervisor(self.dir / "logs", env=CHILD_ENV)
        self.redis: EmbeddedRedis | None = None
        self.store_addr = ""
        self.metrics_urls: dict[str, str] = {}
        self.prom: LocalPrometheus | None = None
        self._last_scrape = self._last_alert_check = 0.0
        self.stopped_by_alert: str | None = None  # stop_on_alert, once it ended the run
        self.started = time.monotonic()
        self.budget = Budget.of(cfg)
        self.stops: dict[str, dict] = {}  # child -> how its stop went (stop_child)
        tqdm.write(f"budget: {self.budget.total():.0f} s for {cfg.grpo.steps} GRPO steps "
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
        self.metrics_urls["store"] = f"http://127.0.0.1:{mport}/metrics"
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
        self.metrics_urls[f"rollout-{w}"] = f"http://127.0.0.1:{mport}/metrics"

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
        self.metrics_urls["trainer"] = f"http://127.0.0.1:{mport}/metrics"
        return trainer

    def train(self, model_dir: Path) -> list[dict]:
        trainer = self.start_trainer(model_dir)
        self.start_prometheus()
        self.print_endpoints()
        return self._follow(trainer)

    def start_prometheus(self) -> None:
        """A real Prometheus scraping every child with the chart's alert rules, when the
        binary is on the PATH (else one line, and the run goes on without it)."""
        from services.local.prom import LocalPrometheus

        if not self.cfg.prometheus:
            tqdm.write("prometheus: off (config prometheus: false): no alerts evaluated, "
                       "dashboards not rendered")
            return
        binary = LocalPrometheus.binary_on_path()
        if binary is None:
            tqdm.write("prometheus: not on the PATH (Debian package `prometheus`): no alerts "
                       "evaluated, dashboards not rendered" + (
                           f", stop_on_alert {self.cfg.stop_on_alert} never fires"
                           if self.cfg.stop_on_alert else ""))
            return
        self.prom = LocalPrometheus(binary, self.dir / "prometheus", free_port())
        self.prom.start(self.metrics_urls)

    def prometheus_report(self) -> dict:
        """Alerts that fired and every dashboard panel drawn from its own PromQL (PNG per
        dashboard under dashboards/); {} without a Prometheus."""
        from services.local.prom import plot_dashboards

        if self.prom is None:
            return {}
        end = time.time()
        time.sleep(3)  # one more scrape and rule evaluation of the last step
        alerts = self.prom.alerts_fired(self.prom.started, time.time())
        panels = self.prom.dashboard_data(self.prom.started, time.time())
        pngs = plot_dashboards(panels, self.dir / "dashboards", self.prom.started)
        rel = lambda t: round(t - self.prom.started, 1)  # noqa: E731
        return {"url": self.prom.url, "started": self.prom.started,
                "seconds": round(end - self.prom.started, 1),
                "alerts_fired": [{**a, "first": rel(a["first"]), "last": rel(a["last"])}
                                 for a in alerts],
                "dashboards": [str(p) for p in pngs],
                "panels": len(panels),
                "empty_panels": [f"{p.dashboard} / {p.title}" for p in panels if p.empty]}

    def _follow(self, trainer) -> list[dict]:
        """Print a table row per step as the trainer logs it; wait for the trainer to exit."""
        log_path = self.dir / "trainer" / "train_log.jsonl"
        steps = self.cfg.grpo.steps
        bar = tqdm(total=steps, desc=f"GRPO ({self.cfg.replay})", unit="step")
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
            if rows and time.monotonic() - self._last_scrape > 5:
                self.snapshot_metrics()
            if rows and self.alert_fired():
                self.snapshot_metrics()
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

    def alert_fired(self) -> bool:
        """Whether `stop_on_alert` has been evaluated as firing twice (checked once per rule
        evaluation); its name goes to `stopped_by_alert` in the summary."""
        from services.local.prom import SCRAPE_S

        alert = self.cfg.stop_on_alert
        if alert is None or self.prom is None or \
                time.monotonic() - self._last_alert_check < SCRAPE_S:
            return False
        self._last_alert_check = time.monotonic()
        if self.prom.firing_evaluations(alert) < 2:
            return False
        tqdm.write(f"prometheus: {alert} fired (stop_on_alert): stopping the trainer")
        self.stopped_by_alert = alert
        return True

    def snapshot_metrics(self) -> None:
        """Keep the latest /metrics text of every live child under metrics/ (for the report and
        for checking that every dashboard/alert metric is really exported)."""
        self._last_scrape = time.monotonic()
        out = self.dir / "metrics"
        out.mkdir(exist_ok=True)
        for name, url in self.metrics_urls.items():
            try:
                text = urllib.request.urlopen(url, timeout=5).read().decode()
            except OSError:
                continue  # a child that already exited keeps its last snapshot
            (out / f"{name}.prom").write_text(text)

    def print_endpoints(self) -> None:
        tqdm.write(f"store gRPC on {self.store_addr} (loopback, no TLS: local mode)")
        if self.prom is not None:
            tqdm.write(f"prometheus {self.prom.url} (the chart's alert rules; data in "
                       f"{self.prom.dir})")
        for name, url in self.metrics_urls.items():
            tqdm.write(f"metrics: {name:<10} {url}")

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
        self.snapshot_metrics()
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
        summary = self._summary(rows, trajectories, out_of_budget=failure,
                                prometheus=self.prometheus_report())
        report.plot_report(rows, self.dir / "report.png", f"r3flow local — replay="
                           f"{self.cfg.replay}, {len(rows)} of {over.steps} GRPO steps "
                           f"(out of budget)")
        return summary

    def finish(self, rows: list[dict]) -> dict:
        """Stop the workers, account for every trajectory, write summary + report."""
        self.snapshot_metrics()
        self.stop_rollouts()
        summary = self._summary(rows, self._account().as_dict(),
                                prometheus=self.prometheus_report())
        report.plot_report(rows, self.dir / "report.png",
                           f"r3flow local — replay={self.cfg.replay}, {len(rows)} GRPO steps")
        return summary

    def abort(self, died: ChildDied) -> dict:
        """A child died: stop the others by pid (workers first, so they report their groups,
        then the trainer), account for what the store holds while it still runs, and write
        summary.json naming the child that died."""
        self.snapshot_metrics()
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
                                  self.cfg.grpo.group_size, in_flight)

    def _summary(self, rows: list[dict], trajectories: dict, **extra: object) -> dict:
        summary = {"run_dir": str(self.dir), "replay": self.cfg.replay, "steps": len(rows),
                   "max_policy_lag": self.cfg.grpo.max_policy_lag,
                   "measure_every": self.cfg.grpo.measure_every,
                   "budget_s": round(self.budget.total(), 1), "stops": self.stops,
                   "wall_seconds": round(time.monotonic() - self.started, 1),
                   **report.summarize(rows), "trajectories": trajectories,
                   "stopped_by_alert": self.stopped_by_alert, **extra}
        write_json(self.dir / "summary.json", summary)
        return summary

    def close(self) -> None:
        if self.prom is not None:
            self.prom.stop()
        self.stop_rollouts()  # within their own stop bound (stop_all gives each child 15 s)
        self.sup.stop_all()
        if self.redis is not None:
            self.redis.stop()
