"""Fault injection on the `r3flow local` topology (LocalRun's steps and Supervisor).

A `FaultRun` runs redis-server, the store, one rollout worker with a fixed number of prompts
and the trainer, injects faults (SIGKILL of the store / a rollout worker mid-generation / the
trainer mid-step, a hard redis-server restart, the store frozen by SIGSTOP for 30 s) and, once
the workers have rolled out every prompt, stops the trainer and accounts for every trajectory
from three sides: the workers' summaries, the store's counters and drained leftovers, and the
trainer's `trained_ids.jsonl`.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.common.tiny_moe import TinyMoeConfig
from services.local.accounting import Accounting
from services.local.config import LocalConfig, resolved, rollout_concurrency
from services.local.procs import wait_for
from services.local.run import LocalRun
from services.store.client import StoreClient
from trainer.loop.ledger import read_trained_ids

log = logging.getLogger(__name__)

FREEZE_S = 30.0  # the store unreachable (SIGSTOP) for this long


def fault_config(runs_dir: Path, num_prompts: int) -> LocalConfig:
    """A small local run: one worker, groups of 4, 2 groups per step, short leases."""
    return LocalConfig(runs_dir=str(runs_dir), workers=1, warm_start_steps=5, timeout_s=1200,
                       model=TinyMoeConfig(), store={"max_policy_lag": 2},
                       rollout={"sampling": {"n": 4, "max_tokens": 6},
                                "num_prompts": num_prompts},
                       trainer={"run": {"steps": 100_000, "launcher": "local"},
                                "data": {"groups_per_step": 2, "lease_seconds": 20},
                                "replay": {"compare_off": False},
                                "weight_sync": {"timeout_s": 20}})


@dataclass
class FaultRun:
    """One local run under faults; `faults` lists what was injected, in order."""

    cfg: LocalConfig
    faults: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.run = LocalRun(self.cfg)
        self.model_dir: Path | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        run = self.run
        self.model_dir = run.warm_start(run.prepare())
        run.start_services(self.model_dir)
        run.start_trainer(self.model_dir)

    def close(self) -> None:
        self.run.close()

    # ------------------------------------------------------------------ observation
    @property
    def trainer_dir(self) -> Path:
        return self.run.dir / "trainer"

    def trained_steps(self) -> int:
        path = self.trainer_dir / "trained_ids.jsonl"
        return len(read_trained_ids(path)) if path.is_file() else 0

    def worker_progress(self, name: str = "rollout-0") -> dict:
        path = self.run.summary_path(name)
        return json.loads(path.read_text()) if path.is_file() else {}

    def wait_steps(self, more: int, timeout_s: float = 300) -> None:
        """Evidence of recovery: the trainer takes `more` new steps."""
        target = self.trained_steps() + more
        wait_for(lambda: self.trained_steps() >= target, timeout_s,
                 f"trainer step {target}", interval_s=0.5, supervisor=self.run.sup)

    def wait_generating(self, name: str = "rollout-0", timeout_s: float = 300) -> None:
        if not self.run.child(name).alive():
            raise RuntimeError(f"{name} already rolled out all its prompts: raise num_prompts")
        wait_for(lambda: self.worker_progress(name).get("groups_in_flight", 0) > 0,
                 timeout_s, f"{name} generating", interval_s=0.1, supervisor=self.run.sup)

    def _note(self, kind: str, **info: object) -> None:
        log.info("fault injected: %s %s", kind, info)
        self.faults.append({"kind": kind, "t": round(time.monotonic() - self.run.started, 1),
                            "trainer_step": self.trained_steps(), **info})

    def _wait_store(self) -> None:
        with StoreClient(self.run.store_addr, timeout_s=5, max_retries=2) as client:
            client.wait_ready(60)

    # ------------------------------------------------------------------ faults
    def kill_store(self, restart: bool = True) -> None:
        self.run.sup.kill(self.run.child("store"))
        self._note("store_sigkill")
        if restart:
            self.run.restart_child("store")
            self._wait_store()

    def kill_rollout(self, name: str = "rollout-0", restart: bool = True) -> None:
        self.wait_generating(name)
        in_flight = self.worker_progress(name).get("groups_in_flight", 0)
        self.run.sup.kill(self.run.child(name))
        self._note("rollout_sigkill", groups_in_flight=in_flight)
        if restart:
            self.run.restart_child(name)

    def kill_trainer(self, restart: bool = True) -> None:
        """SIGKILL right after a step trained, while its weight push and checkpoint run: the
        restarted trainer must roll that step back and train its groups again, once."""
        lines = self._ids_lines()
        wait_for(lambda: self._ids_lines() > lines, 300, "a trained step", interval_s=0.01,
                 supervisor=self.run.sup)
        self.run.sup.kill(self.run.child("trainer"))
        self._note("trainer_sigkill", after_step=self.trained_steps())
        if restart:
            self.run.restart_child("trainer")

    def _ids_lines(self) -> int:
        path = self.trainer_dir / "trained_ids.jsonl"
        return path.read_bytes().count(b"\n") if path.is_file() else 0

    def restart_redis(self) -> None:
        assert self.run.redis is not None
        self.run.redis.restart(hard=True)  # SIGKILL; the AOF brings the data back
        self._note("redis_restart")

    def freeze_store(self, seconds: float = FREEZE_S) -> None:
        store = self.run.child("store")
        self.run.sup.kill(store, signal.SIGSTOP)
        self._note("store_unreachable", seconds=seconds)
        time.sleep(seconds)
        self.run.sup.kill(store, signal.SIGCONT)

    def all_at_once(self, last_prompts: int) -> None:
        """Store, rollout worker (mid-generation) and trainer SIGKILLed and redis-server
        restarted at the same moment; then everything starts again, the worker with
        `last_prompts` prompts (its final incarnation: the run ends when they are done)."""
        self.wait_generating()
        in_flight = self.worker_progress().get("groups_in_flight", 0)
        for name in ("rollout-0", "trainer", "store"):
            self.run.sup.kill(self.run.child(name))
        self.restart_redis()
        self._note("combined", kinds=["rollout_sigkill", "trainer_sigkill", "store_sigkill",
                                      "redis_restart"], groups_in_flight=in_flight)
        self.run.restart_child("store")
        self._wait_store()
        self.run.restart_child("trainer")
        self.run.restart_child("rollout-0", ("--set", f"num_prompts={last_prompts}"))

    # ------------------------------------------------------------------ the end
    def finish(self, timeout_s: float = 900) -> dict:
        """Wait for the workers to roll out all their prompts, let the trainer take what makes
        a full batch, stop it, wait out the leases of a partial batch, account."""
        run, tc = self.run, resolved(self.cfg, "trainer")
        workers = [c for c in run.sup.children if c.name.startswith("rollout")]
        wait_for(lambda: not any(c.alive() for c in workers), timeout_s, "workers to finish",
                 interval_s=1.0, supervisor=run.sup)
        with StoreClient(run.store_addr, timeout_s=10, max_retries=5) as client:
            wait_for(lambda: client.stats().groups_ready < tc.data.groups_per_step, 300,
                     "trainer to take every full batch", interval_s=1.0, supervisor=run.sup)
            time.sleep(3)  # a step in progress ends with its checkpoint and ack
            run.sup.stop(run.child("trainer"), timeout_s=120)
            held = client.stats().groups_leased
        # A stopped trainer may hold a partial batch: its leases expire, then the drain in
        # Accounting.collect takes those groups as unused (never trained, never acked). Held
        # none (delivered groups are all acked): nothing to wait for.
        log.info("the stopped trainer held %d leased group(s)", held)
        if held:
            time.sleep(tc.data.lease_seconds + 2)
        acct = Accounting.collect(run.store_addr, run.worker_summaries(), run.rollout_cfg.sampling.n,
                                  self.cfg.workers * rollout_concurrency(self.cfg))
        return self.report(acct)

    def rolled_back(self) -> int:
        """Steps a killed trainer trained but never checkpointed (their groups came back)."""
        seen: set[int] = set()
        count = 0
        for line in (self.trainer_dir / "trained_ids.jsonl").read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # torn by the kill: that step never reached its checkpoint
            if "resumed_at" in rec:
                count += sum(s > rec["resumed_at"] for s in seen)
                seen = {s for s in seen if s <= rec["resumed_at"]}
            else:
                seen.add(rec["step"])
        return count

    def report(self, acct: Accounting) -> dict:
        steps = read_trained_ids(self.trainer_dir / "trained_ids.jsonl")
        ids = [t for s in sorted(steps) for t in steps[s]]
        out = {"faults": self.faults, "accounting": acct.as_dict(),
               "trainer_steps": len(steps), "steps_rolled_back": self.rolled_back(),
               "trained_ids": len(ids),
               "trained_unique": len(set(ids)), "worker_summaries": self.run.worker_summaries(),
               "trainer_exit": self.run.child("trainer").proc.returncode,
               "wall_seconds": round(time.monotonic() - self.run.started, 1)}
        (self.run.dir / "faults.json").write_text(json.dumps(out, indent=1))
        return out
