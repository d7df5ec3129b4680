"""The store-driven training loop, split into named steps:
pull_batch -> (ranks) intake + train_step -> publish_version -> push_weights
-> checkpoint (+ ack) -> export_hf (every run.hf_export_every steps: HF-format weights).

Run fencing (docs/store.md): a run has an id (made when it starts fresh, kept in its
checkpoints). At resume the trainer starts its run at the store; a run new to the store gets a
policy version above every earlier one, and its initial weights are pushed before the first pull,
so no group sampled by another run's weights is ever trained (the store drops them `other_run`).

Staleness: the policy version moves and is published to the store after every update (the
store's stale drop and the rollouts' throttle read it), not only at checkpoints; at intake a
group whose oldest segment lags it by more than `data.max_policy_lag` is acked as dropped
`stale`, never trained (trainer.loop.staleness). A resumed trainer republishes its version.

Data position: groups are acked only once a checkpoint that contains their step is written, so
a crashed trainer's un-acked groups are redelivered by the store after their lease and nothing
is lost; a redelivered group whose id is in the checkpoint's trained set is acked, not retrained.
Every trained step is also written to the trained-ids ledger (trainer.loop.ledger) before its
checkpoint. Batches are split between data-parallel ranks by whole GRPO groups (advantages are
per group) and every rank gets the same number of groups; groups differ in size and some get
quarantined, so the ranks also agree on a micro-batch count per pass (the backends'
`microbatches`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from services.store.errors import RateLimit, UnackedFull
from trainer.checkpoint import DataPosition
from trainer.config import TrainerConfig
from trainer.hooks import StepHook, before_step, load_hooks
from trainer.loop.batch_stats import StepStats
from trainer.loop.dynamic_sampling import REASON as EQUAL_REWARDS
from trainer.loop.dynamic_sampling import DynamicSampler, equal_reward_groups
from trainer.loop.eval_feed import EvalFeed
from trainer.loop.ledger import TrainedIdsLedger
from trainer.loop.metrics import TrainerMetrics, reduce_metrics
from trainer.loop.ranks import Ranks, RankTransport
from trainer.loop.staleness import is_stale, staleness
from trainer.loop.tracking import Tracker, open_trackers, scalars_of

log = logging.getLogger(__name__)

UNACKED_WAIT_S = 1.0  # a pull refused for un-acked groups it cannot ack is tried again after
RESYNC_INTERVAL_S = 10.0  # how often an idle trainer re-pushes to workers behind its version
PushFn = Callable[[Ranks, int, str], None]  # trainer.weight_push.StoreWeightPush


# (label, metric) of a step's parts in the order they run: the step line says where time went
STEP_PARTS = (("wait", "batch_wait_seconds"), ("old", "old_pass_seconds"),
              ("ref", "ref_pass_seconds"), ("no-replay", "compare_off_seconds"),
              ("update", "update_seconds"), ("push", "weight_push_seconds"),
              ("checkpoint", "checkpoint_seconds"))


def step_parts(metrics: dict) -> str:
    """'wait 0.41 s, old 0.05 s, ..., checkpoint 0.30 s' of one step (parts it did not run
    are left out); generation runs beside the step and shows as its batch wait."""
    return ", ".join(f"{label} {metrics[key]:.2f} s" for label, key in STEP_PARTS
                     if isinstance(metrics.get(key), int | float))


class TrainLoop:
    """Drives the ranks from the store; owns acks, metrics and the run log."""

    def __init__(self, cfg: TrainerConfig, ranks: Ranks | RankTransport, client,
                 metrics: dict[str, Any] | None = None, push_fn: PushFn | None = None,
                 hooks: Sequence[StepHook] | None = None,
                 trackers: Sequence[Tracker] | None = None) -> None:
        if cfg.data.groups_per_step % ranks.world_size:
            raise ValueError(f"data.groups_per_step: {cfg.data.groups_per_step} not divisible "
                             f"by {ranks.world_size} ranks")
        self.ranks = ranks if isinstance(ranks, Ranks) else Ranks(ranks)
        self.cfg, self.client = cfg, client
        self.metrics, self.push_fn = TrainerMetrics.of(metrics), push_fn
        self.sampler = DynamicSampler(cfg.data)
        # the step hooks (trainer.hooks): consulted here, once per step, for every rank
        self.hooks = load_hooks(cfg.hooks) if hooks is None else list(hooks)
        self.pending_acks: list[str] = []
        self.saving_acks: list[str] | None = None  # acks of the background save in flight
        # This process's pulls: the store renews (does not redeliver) our own expired leases,
        # so a batch that waits long is not dead-lettered; a restarted trainer is a new session.
        self.session = uuid.uuid4().hex
        self._last_resync = 0.0
        self._unacked_log = RateLimit(60.0)
        self._hf_exported = -1  # step of the last HF export (no second one at the same step)
        self.pos = DataPosition()
        self.run_log = Path(cfg.run.run_dir) / "train_log.jsonl"
        self.ledger = TrainedIdsLedger(Path(cfg.run.run_dir) / "trained_ids.jsonl")
        self.stats = StepStats(cfg, self.ranks.world_size)
        self.evals = EvalFeed(cfg.run.eval_log)
        # TensorBoard (and W&B / MLflow) of the step metrics; the CLI passes its own and closes
        self.trackers = (open_trackers(cfg.tracking, self.run_log.parent) if trackers is None
                         else list(trackers))
        self.run_log.parent.mkdir(parents=True, exist_ok=True)

    def resume(self) -> None:
        """Restore every rank from the latest checkpoint, if any; a run with none starts at the
        store's current policy version (a new named run against a long-lived release)."""
        got = self.ranks.resume()
        if got is not None:
            self.pos = DataPosition(**got)
            log.info("resumed at step %d, policy version %d", self.pos.step, self.pos.policy_version)
            self._version_above_engines()
        else:
            self._version_of_store()
        self.ledger.resumed(self.pos.step)
        if self._start_run():
            self._push_now()  # the run's initial weights, before it takes any group
        else:
            self.publish_version()

    def _start_run(self) -> bool:
        """Start (or resume) this run at the store; True when the store started it above the
        versions of earlier runs (its version moved: push the initial weights). A trainer that
        never pushes cannot fence: its engines never serve its weights."""
        if self.push_fn is None or not self.cfg.run.push_weights_every:
            return False
        self.pos.run_id = self.pos.run_id or uuid.uuid4().hex[:16]
        got = self.client.start_run(self.pos.run_id, self.pos.policy_version)
        if got.version <= self.pos.policy_version:
            return False
        log.info("run %s starts at policy version %d: pushing its initial weights before the "
                 "first pull", self.pos.run_id, got.version)
        self._set_version(got.version)
        return True

    def _version_of_store(self) -> None:
        """The store and its engines may be at version N from earlier runs: they ignore plans
        and versions at or below what they have, so a fresh run continues from N."""
        current = max([w.policy_version for w in self.client.list_workers()]
                      + [self.client.stats().policy_version])
        if current > self.pos.policy_version:
            log.info("no checkpoint: continuing from the store's policy version v%d", current)
            self._set_version(current)

    def _version_above_engines(self) -> None:
        """A crash between a weight push and its checkpoint leaves engines serving a version
        the checkpoint never reached; label the resumed weights at least that high, so the
        next push is newer than anything an engine serves (engines ignore older plans)."""
        if self.push_fn is None:
            return
        served = max([w.policy_version for w in self.client.list_workers()]
                     + [self.client.stats().policy_version])
        if served > self.pos.policy_version:
            log.warning("engines serve v%d > checkpoint's v%d: continuing from v%d", served,
                        self.pos.policy_version, served)
            self._set_version(served)

    def _set_version(self, version: int) -> None:
        self.ranks.set_policy_version(version)
        self.pos.policy_version = version

    def pull_batch(self, stop: Callable[[], bool] = lambda: False) -> list:
        """Lease `groups_per_step` groups (redelivered, already-trained groups are just acked);
        an incomplete batch is returned only when `stop()` says so (its leases then expire).

        A batch that waits longer than the lease for its last groups (a frozen store, rollout
        engines restarting) gets its first groups redelivered to this same consumer: such a
        group is taken once, as its newest delivery, never twice in one step."""
        d = self.cfg.data
        batch: dict[str, object] = {}  # group id -> its newest delivery, in pull order
        trained = set(self.pos.trained_group_ids)
        self.sampler.start_step()
        while len(batch) < d.groups_per_step:
            if stop():
                return []
            got = self._pull(d.groups_per_step - len(batch))
            if not got:
                # a background save's acks free the store's backlog: a save written while the
                # store waits for room must be published now, not after a batch that cannot come
                self.finish_checkpoint(block=False)
                self.resync_lagging_workers()
            # A group already in the batch (its lease renewed while the batch waited) was
            # judged when it came: it is taken as its newest delivery, never dropped now.
            new = [g for g in got if g.group_id not in trained and g.group_id not in batch]
            fresh = self.drop_equal_rewards(self.drop_stale(new))
            self.pending_acks += [g.delivery_id for g in got if g.group_id in trained]
            batch.update((g.group_id, g) for g in got if g.group_id in batch)
            batch.update((g.group_id, g) for g in fresh)
        return list(batch.values())

    def _pull(self, max_groups: int) -> list:
        """One pull. A store that holds max_unacked_tokens of delivered, un-acked groups
        refuses it (UnackedFull): the trainer checkpoints now, which acks the groups it trained,
        instead of at its cadence (docs/store.md "Admission and acks")."""
        d = self.cfg.data
        try:
            return self.client.pull(d.consumer, max_groups, lease_seconds=d.lease_seconds,
                                    wait_ms=d.wait_ms, session=self.session)
        except UnackedFull as full:
            if self.pending_acks:
                log.warning("step %d: early checkpoint to ack %d groups: %s", self.pos.step,
                            len(self.pending_acks), full)
                self.checkpoint(force=True)
            elif self.saving_acks:  # a background save holds them: its publish acks them
                self.finish_checkpoint(block=True)
            else:  # what the store holds is this batch's or another session's (leases expire)
                if self._unacked_log.due("wait"):
                    log.warning("step %d: nothing to ack, waiting: %s (is max_unacked_tokens "
                                "below one step's tokens?)", self.pos.step, full)
                time.sleep(UNACKED_WAIT_S)
            return []

    def drop_equal_rewards(self, groups: list) -> list:
        """DAPO dynamic sampling (trainer.loop.dynamic_sampling): equal-reward groups acked as
        dropped `equal_rewards`; returns the others."""
        keep, drop = self.sampler.split(groups)
        if drop:
            self.client.ack(self.cfg.data.consumer, [], dropped=[
                (g.delivery_id, EQUAL_REWARDS, len(g.trajectories)) for g in drop])
        return keep

    def drop_stale(self, groups: list) -> list:
        """Ack as dropped `stale` the groups older than `data.max_policy_lag` versions (their
        oldest segment counts); returns the others."""
        lag = self.cfg.data.max_policy_lag
        if lag is None:
            return groups
        v = self.pos.policy_version
        stale = [g for g in groups if is_stale(g, v, lag)]
        if stale:
            self.client.ack(self.cfg.data.consumer, [], dropped=[
                (g.delivery_id, "stale", len(g.trajectories)) for g in stale])
            self.metrics.stale(len(stale))
            log.warning("dropped %d stale group(s) at intake (trainer v%d, max_policy_lag %d): "
                        "%s", len(stale), v, lag,
                        ", ".join(f"{g.group_id} ({staleness(g, v)} behind)" for g in stale))
        dropped = {g.group_id for g in stale}
        return [g for g in groups if g.group_id not in dropped]

    def lr_scale(self, hooks_scale: float) -> float:
        """The coming step's lr as a multiple of optim.lr: the schedule's (trainer.lr_schedule,
        a function of the step, so resumed runs continue it) times the step hooks'."""
        if hooks_scale != 1.0:
            log.warning("step %d at lr x %g (a step hook)", self.pos.step + 1, hooks_scale)
        return self.cfg.learning_rate(self.pos.step) / self.cfg.optim.lr * hooks_scale

    def train_step(self, groups: list, lr_scale: float = 1.0) -> dict:
        """Scatter whole groups to the ranks; each aligns routing and steps (its updates at lr x
        `lr_scale`); reduce metrics."""
        n = self.ranks.world_size
        shares = [[g.SerializeToString() for g in groups[r::n]] for r in range(n)]
        per_rank = self.ranks.train(shares, lr_scale)
        dropped = {g: why for m in per_rank for g, why in m.pop("dropped", {}).items()}
        metrics = reduce_metrics(per_rank)
        metrics["learning_rate"] = self.cfg.optim.lr * lr_scale
        self.quarantine([g for g in groups if g.group_id in dropped], dropped)
        groups = [g for g in groups if g.group_id not in dropped]
        metrics["groups_quarantined"] = len(dropped)
        metrics["groups_quarantined_by_reason"] = dict(Counter(dropped.values()))
        metrics["groups_trained"] = len(groups)
        metrics["groups_equal_rewards"] = equal_reward_groups(groups)
        metrics |= self.sampler.metrics(len(groups))
        self.pos.step += 1
        metrics |= self.stats.of(self.pos.step, groups, metrics)
        self.pos.policy_version = int(metrics["policy_version"])
        self.pos.remember([g.group_id for g in groups])
        self.pending_acks += [g.delivery_id for g in groups]
        self.ledger.step(self.pos.step, self.pos.policy_version,
                         [t.trajectory_id for g in groups for t in g.trajectories],
                         [_prompt_of(g) for g in groups])
        return metrics

    def quarantine(self, groups: list, reasons: dict[str, str]) -> None:
        """Ack quarantined groups to the store as dropped (dropped_by_reason) right away: never
        trained on, never redelivered to a restarted trainer (no crash loop)."""
        if not groups:
            return
        self.client.ack(self.cfg.data.consumer, [], dropped=[
            (g.delivery_id, reasons[g.group_id], len(g.trajectories)) for g in groups])
        for g in groups:
            log.error("group %s quarantined: %s", g.group_id, reasons[g.group_id])
            self.metrics.quarantined(reasons[g.group_id])

    def resync_lagging_workers(self) -> None:
        """While no group is ready, push the current weights again (at most every
        RESYNC_INTERVAL_S) if a registered worker serves an older version. A worker restarted
        after the last push (or one that missed it) otherwise holds its groups for policy lag
        while the trainer waits for groups: neither side would ever move."""
        if self.push_fn is None or not self.cfg.run.push_weights_every or \
                not self.pos.step and not self.pos.run_id:
            return
        if time.monotonic() - self._last_resync < RESYNC_INTERVAL_S:
            return
        self._last_resync = time.monotonic()
        behind = [w.worker_id for w in self.client.list_workers()
                  if w.policy_version < self.pos.policy_version]
        if behind:
            # A plan version is pushed once: the same weights go out under the next version.
            log.warning("idle with worker(s) %s behind v%d: pushing the weights again as v%d",
                        behind, self.pos.policy_version, self.pos.policy_version + 1)
            self._set_version(self.pos.policy_version + 1)
            self.publish_version()
            self._push_now()

    def publish_version(self) -> None:
        """Publish the trainer's policy version to the store (after every update, at resume):
        the store's stale drop and the rollouts' throttle read it. The store never lowers it."""
        self.client.publish_policy_version(self.pos.policy_version)

    def push_weights(self) -> None:
        """Push the weights to the rollout engines (trainer.weight_push; rank 0 sends)."""
        every = self.cfg.run.push_weights_every
        if self.push_fn is None or not every or self.pos.step % every:
            return
        self._push_now()

    def _push_now(self) -> None:
        assert self.push_fn is not None
        t0 = time.perf_counter()
        self.push_fn(self.ranks, self.pos.policy_version, self.pos.run_id)  # rank 0 sends
        self.metrics.weight_push(time.perf_counter() - t0)
        # Workers report the version they loaded a moment after the push returns: a resync
        # check right after it saw them still behind and pushed the same weights again (and a
        # worker stopping meanwhile never joined that push, which then waited out timeout_s).
        self._last_resync = time.monotonic()

    def checkpoint(self, force: bool = False) -> None:
        """Save every rank's shard, then ack what it covers (the version was published at
        its step already). A background save (run.async_checkpoint) is acked at the boundary
        where every rank has written it (`finish_checkpoint`); a forced one is waited for."""
        self.finish_checkpoint(block=force)
        if not force and self.pos.step % self.cfg.run.checkpoint_every:
            return
        acks, self.pending_acks = self.pending_acks, []
        self.pos.acked_delivery_ids = acks
        self.ranks.save(self.pos)
        self.saving_acks = acks
        self.finish_checkpoint(block=force or not self.cfg.run.async_checkpoint)

    def finish_checkpoint(self, block: bool) -> None:
        """Ack the groups of the save in flight once it is published (a crash before that
        resumes from the previous checkpoint, and the store redelivers them)."""
        if self.saving_acks is None:
            return
        if self.cfg.run.async_checkpoint and self.ranks.finish_checkpoint(block) is None:
            return
        acks, self.saving_acks = self.saving_acks, None
        if acks:
            self.client.ack(self.cfg.data.consumer, acks)

    def export_hf(self, final: bool = False) -> None:
        """Every `run.hf_export_every` steps (and at the end of a run): the full weights in HF
        format under `<run_dir>/hf/step-N`, `hf/latest` moved to it (rank 0 writes)."""
        every = self.cfg.run.hf_export_every
        if not every or self._hf_exported == self.pos.step or (
                not final and self.pos.step % every):
            return
        path = self.ranks.export_hf_dir(self.pos.step)
        self._hf_exported = self.pos.step
        log.info("step %d: HF export %s", self.pos.step, path)

    def run(self, steps: int, stop: Callable[[], bool] = lambda: False) -> list[dict]:
        """Take `steps` optimizer steps (0 = until `stop()`); returns their metrics."""
        history: list[dict] = []
        while (steps == 0 or len(history) < steps) and not stop():
            control = before_step(self.hooks, self.pos.step, self.pos.policy_version)
            if control.stop:
                log.info("step %d: a step hook ends the run", self.pos.step + 1)
                break
            t0 = time.perf_counter()
            groups = self.pull_batch(stop)
            if not groups:
                break
            t1 = time.perf_counter()
            metrics = self.train_step(groups, self.lr_scale(control.lr_scale))
            self.publish_version()
            t2 = time.perf_counter()
            if not stop():  # stopping: the engines are going too (SIGTERM between passes)
                self.push_weights()
            t3 = time.perf_counter()
            self.checkpoint()
            self.export_hf()
            # where the loop's time went besides the ranks' step (r3flow local's bench)
            metrics |= {"batch_wait_seconds": t1 - t0, "weight_push_seconds": t3 - t2,
                        "checkpoint_seconds": time.perf_counter() - t3}
            log.info("step %d: %s", self.pos.step, step_parts(metrics))
            self.record(metrics)
            history.append(metrics)
        if history:
            self.checkpoint(force=True)
            self.export_hf(final=True)
            # a stopped trainer does not wait for engines that are being stopped as well
            self.await_engines(0.0 if stop() else self.cfg.run.exit_engine_wait_s)
        return history

    def await_engines(self, timeout_s: float) -> None:
        """Before the trainer exits (and its push rendezvous store with it): wait, bounded, until
        every registered engine reports the last pushed version, so none is left polling a gone
        store for the commit of the final push."""
        if self.push_fn is None or not self.cfg.run.push_weights_every or timeout_s <= 0:
            return
        deadline, behind = time.monotonic() + timeout_s, ['?']
        while time.monotonic() < deadline:
            behind = [w.worker_id for w in self.client.list_workers()
                      if w.policy_version < self.pos.policy_version]
            if not behind:
                return
            time.sleep(0.5)
        log.warning("engines %s still behind v%d at exit", behind, self.pos.policy_version)

    # ------------------------------------------------------------------ observability
    def record(self, m: dict) -> None:
        """Export a step's metrics to Prometheus, the JSONL run log and the trackers."""
        m |= self.evals.new_metrics()
        self.metrics.export_step(m)
        with self.run_log.open("a") as f:
            f.write(json.dumps({"step": self.pos.step, "time": time.time(), **m}) + "\n")
        scalars = scalars_of(m)
        for t in self.trackers:
            t.log(self.pos.step, scalars)


def _prompt_of(group) -> tuple[str, int, str]:  # noqa: ANN001 (a store_pb2.PulledGroup)
    """(worker_id, epoch, prompt_id) of a group's prompt (its trajectories share it)."""
    t = group.trajectories[0] if group.trajectories else None
    return (t.worker_id, t.epoch, t.prompt_id) if t is not None else ("", 0, "")
