"""TrajectoryStoreCore: the store's logic over a Redis client, with no gRPC in sight.

Append: services/store/append.py (validate a whole stream, then commit it by Lua scripts).
Pull/ack: complete groups are entries of a Redis Stream read by one consumer group; a pull
first claims entries whose lease expired, then reads new ones. An expired lease taken back by the
puller's own session is renewed (not a redelivery); a group redelivered more than
`max_redeliveries` times is dead-lettered (services/store/dead_letter.py).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from prometheus_client import CollectorRegistry

from services.common.metrics import create_metrics
from services.common.pb.r3flow.v1 import store_pb2
from services.common.staleness import too_stale
from services.store import lua
from services.store.append import Appender, AppendResult
from services.store.assemble import Delivery, assemble_group
from services.store.config import StoreConfig
from services.store.dead_letter import REASON as DEAD_LETTER
from services.store.dead_letter import dead_letter_of, keep
from services.store.errors import CapacityError, redis_full
from services.store.keys import CONSUMER_GROUP, Keys
from services.store.leases import Entry, LeaseClock, Puller, as_str, check_delivery_id, parse_lease
from services.store.run_fence import OTHER_RUN, RunFence

log = logging.getLogger(__name__)
_REASON = re.compile(r"[a-z_]{1,40}")
_STORE_REASONS = ("acked", "aborted", "missing", OTHER_RUN, DEAD_LETTER)


@dataclass
class StatsSnapshot:
    counters: dict[str, int] = field(default_factory=dict)
    groups_ready: int = 0
    groups_pending: int = 0
    policy_version: int = 0
    groups_open: int = 0
    run: RunFence | None = None

    def dropped_by_reason(self) -> dict[str, int]:
        return {k.removeprefix("dropped:"): v for k, v in self.counters.items()
                if k.startswith("dropped:")}


class TrajectoryStoreCore:
    """Append, pull, ack, policy version and stats over one Redis (see module docstring)."""

    def __init__(self, client: redis.Redis, config: StoreConfig,
                 registry: CollectorRegistry | None = None,
                 clock: LeaseClock | None = None) -> None:
        self.r: Any = client  # redis-py's annotations mix sync and async replies
        self.cfg = config
        self.clock = clock or LeaseClock()
        self.keys = Keys(config.key_prefix)
        self.metrics = create_metrics(registry or CollectorRegistry(), "store")
        self.version_changed = threading.Condition()
        self._scripts = {name: client.register_script(getattr(lua, name)) for name in
                         ("RELEASE", "TIMEOUT", "SET_MAX", "MARK_DELIVERED", "START_RUN")}
        self.appender = Appender(client, config, self.keys, self._metric)
        self.ensure_stream()

    # ---- setup -------------------------------------------------------------------------
    def ensure_stream(self) -> None:
        """Create the ready stream and its consumer group if Redis does not have them."""
        try:
            self.r.xgroup_create(self.keys.ready, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def redis_full(self, what: str, exc: Exception) -> CapacityError:
        """A write Redis refused at its maxmemory, as backpressure naming the limit."""
        log.warning("%s refused by Redis: %s", what, exc)
        self._metric("r3flow_store_rejections_total", "redis_full").inc()
        return redis_full(what, self.r.info("memory"), self.cfg.backpressure_retry_ms)

    def _metric(self, name: str, *labels: str) -> Any:
        m: Any = self.metrics[name]
        return m.labels(*labels) if labels else m

    def append(self, requests: Iterable[store_pb2.AppendRequest],
               before_commit: Callable[[], None] | None = None) -> AppendResult:
        """Validate a whole Append stream, then commit it (services/store/append.py)."""
        result = self.appender.append(requests, before_commit)
        result.policy_version = self.policy_version()
        return result

    # ---- pull / ack ----------------------------------------------------------------------
    def pull(self, consumer: str, max_groups: int, lease_seconds: int = 0,
             wait_ms: int = 0, session: str = "") -> list[Delivery]:
        """Up to `max_groups` complete groups, leased to `consumer` (expired leases first);
        `session` names the puller's process (see the module docstring)."""
        if not consumer:
            raise ValueError("consumer: required (names the lease holder)")
        if max_groups < 1:
            raise ValueError(f"max_groups: {max_groups} < 1")
        t0 = time.perf_counter()
        try:
            out = self._pull(Puller(consumer, session), max_groups, lease_seconds, wait_ms)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self.ensure_stream()  # Redis lost its data (no AOF): start a fresh stream
            out = []
        self._metric("r3flow_store_pull_seconds").observe(time.perf_counter() - t0)
        return out

    def _pull(self, who: Puller, max_groups: int, lease_seconds: int,
              wait_ms: int) -> list[Delivery]:
        lease_ms = 1000 * (lease_seconds or self.cfg.lease_seconds)
        block = min(wait_ms, self.cfg.max_wait_ms) or None
        out: list[Delivery] = []
        while len(out) < max_groups:
            entries = self._claim_expired(who, max_groups - len(out))
            if self._unacked_full(bool(out or entries)):
                new_count = 0  # what was delivered must be acked before more is
            else:
                new_count = max_groups - len(out) - len(entries)
            entries += self._read_new(who.consumer, new_count, None if entries else block)
            if not entries:
                break
            block = None  # only the first read waits
            self._set_leases(entries, lease_ms + self.clock.ahead_ms, who.session)
            out += [d for d in (self._deliver(e) for e in entries) if d is not None]
        return out

    def _claim_expired(self, who: Puller, count: int) -> list[Entry]:
        ahead = self.clock.ahead_ms  # leases are >= 1 s: entries idle less are never due
        pending = self.r.xpending_range(self.keys.ready, CONSUMER_GROUP, "-", "+",
                                        max(100, 4 * count), idle=max(0, 1000 - ahead))
        if not pending:
            return []
        leases = self.r.hmget(self.keys.leases, [p["message_id"] for p in pending])
        claimed: list[Entry] = []
        redelivered = 0
        limit = self.cfg.max_redeliveries
        for p, lease in zip(pending, leases, strict=True):
            lease_ms, holder = parse_lease(lease, 1000 * self.cfg.lease_seconds)
            if len(claimed) >= count or p["time_since_delivered"] + ahead < lease_ms:
                continue
            min_idle = max(0, lease_ms - ahead)  # in Redis' idle time
            eid, times = as_str(p["message_id"]), int(p["times_delivered"])
            renew = bool(who.session) and holder == who.session
            if not renew and limit is not None and times > limit:
                self._dead_letter(who.consumer, eid, times, as_str(p["consumer"]), min_idle)
                continue
            # XCLAIM re-checks the idle time, so two pullers never both win one entry; without
            # JUSTID it also counts the delivery (a renewal by the same session does not).
            got = self.r.xclaim(self.keys.ready, CONSUMER_GROUP, who.consumer, min_idle, [eid],
                                justid=renew)
            if got and (renew or (got[0] and got[0][0])):
                claimed.append(Entry(eid, times if renew else times + 1, renew))
                redelivered += not renew
        if redelivered:
            self.r.hincrby(self.keys.stats, "redeliveries", redelivered)
            self._metric("r3flow_store_redeliveries_total").inc(redelivered)
        return claimed

    def _dead_letter(self, consumer: str, eid: str, times: int, holder: str,
                     min_idle_ms: int) -> None:
        """Set aside a group delivered `times` times without an ack: its record is kept,
        it is released as dropped `dead_letter` and never delivered again."""
        if not self.r.xclaim(self.keys.ready, CONSUMER_GROUP, consumer, min_idle_ms, [eid],
                             justid=True):
            return  # another puller took it first
        found = self.r.xrange(self.keys.ready, eid, eid)
        gid = as_str(found[0][1][b"g"]) if found else "?"
        d = assemble_group(self.r, self.keys, gid, eid, times) if found else None
        assert self.cfg.max_redeliveries is not None
        rec = dead_letter_of(d, gid, eid, times, holder, self.cfg.max_redeliveries)
        keep(self.r, self.keys, rec, d, self.cfg.tombstone_seconds)
        n = len(rec.trajectory_ids)
        if self._release(eid, consumer, DEAD_LETTER, n) == 1:
            self.r.hincrby(self.keys.stats, "groups_dead_lettered", 1)
            self._metric("r3flow_store_dead_lettered_total").inc()
            self._metric("r3flow_store_dropped_total", DEAD_LETTER).inc(n)
            log.error("group %s dead-lettered: %s (%d trajectories; record in %s)", gid,
                      rec.reason, n, self.keys.dead_letters)

    def _unacked_full(self, delivering: bool) -> bool:
        """Whether delivered, not yet acked tokens reached max_unacked_tokens. Groups whose
        lease expired are still delivered (claimed again, never gated); new groups wait. A pull
        that would get nothing at all is refused (reason `unacked`): the trainer then
        checkpoints early, which acks what it holds (docs/store.md "Admission and acks")."""
        limit = self.cfg.max_unacked_tokens
        if limit is None:
            return False
        held = int(self.r.hget(self.keys.stats, "delivered_tokens") or 0)
        if held < limit:
            return False
        if not delivering:
            self._metric("r3flow_store_rejections_total", "unacked").inc()
            raise CapacityError(
                f"pull: store over max_unacked_tokens={limit} (delivered, not yet acked: "
                f"{held} tokens); ack (checkpoint) before pulling more", reason="unacked",
                retry_after_ms=self.cfg.backpressure_retry_ms)
        return True

    def _read_new(self, consumer: str, count: int, block_ms: int | None) -> list[Entry]:
        if count <= 0:
            return []
        reply = self.r.xreadgroup(CONSUMER_GROUP, consumer, {self.keys.ready: ">"},
                                  count=count, block=block_ms)
        entries = [Entry(as_str(eid), 1) for _, msgs in (reply or []) for eid, _ in msgs]
        if entries:
            self.r.hincrby(self.keys.stats, "groups_delivered", len(entries))
        return entries

    def _set_leases(self, entries: list[Entry], lease_ms: int, session: str) -> None:
        value = f"{lease_ms}|{session}" if session else lease_ms
        self.r.hset(self.keys.leases, mapping={e.eid: value for e in entries})

    def _deliver(self, entry: Entry) -> Delivery | None:
        eid = entry.eid
        found = self.r.xrange(self.keys.ready, eid, eid)
        if not found:
            return None
        gid = as_str(found[0][1][b"g"])
        d = assemble_group(self.r, self.keys, gid, eid, entry.count)
        reason = self._drop_reason(d, entry.renewed)
        if reason:
            n = 0 if d is None else len(d.members)
            self._release(eid, "", reason, n)
            self._metric("r3flow_store_dropped_total", reason).inc(n)
            log.info("dropped group %s (%s, %d trajectories)", gid, reason, n)
            return None
        self._scripts["MARK_DELIVERED"](keys=[self.keys.stats], args=[self.keys.prefix, gid])
        return d

    def _drop_reason(self, d: Delivery | None, renewed: bool = False) -> str:
        """Why a group is dropped instead of delivered ('' = deliver). A renewal is never
        dropped as stale: its holder took the group already (it may be in a batch, or trained
        and waiting for its checkpoint) and judged its staleness then."""
        if d is None:
            log.error("ready group has no payload in Redis; dropping its stream entry")
            return "missing"
        if not d.members:
            return "aborted"  # every member aborted; counted when they finished
        fence = self.run_fence()
        if fence is not None and not fence.admits(d):
            return OTHER_RUN
        if not renewed and too_stale(self.policy_version(), d.min_policy_version,
                                     self.cfg.max_policy_lag):
            return "stale"
        return ""

    def ack(self, consumer: str, delivery_ids: Iterable[str]) -> int:
        """Ack delivered groups held by `consumer` and delete their payloads; returns count."""
        acked = 0
        eids = list(delivery_ids)
        for i, eid in enumerate(eids):
            check_delivery_id(eid, f"delivery_ids[{i}]")
        for eid in eids:
            done = self._release(eid, consumer, "acked", 0)
            if done == -1:
                self._metric("r3flow_store_rejections_total", "ack_not_lease_holder").inc()
            acked += done == 1
        self._metric("r3flow_store_groups_acked_total").inc(acked)
        return acked

    def drop(self, consumer: str, delivery_id: str, reason: str, trajectories: int) -> int:
        """Ack a delivered group the trainer quarantined, counted as dropped by `reason`."""
        check_delivery_id(delivery_id, "dropped.delivery_id")
        # `stale` is shared: a trainer drops at intake what is older than its own lag.
        if not _REASON.fullmatch(reason) or reason in _STORE_REASONS:
            raise ValueError(f"dropped.reason: {reason!r} must match [a-z_]{{1,40}} and not be "
                             "a reason of the store's own")
        done = self._release(delivery_id, consumer, reason, trajectories)
        if done == 1:
            self._metric("r3flow_store_dropped_total", reason).inc(trajectories)
            log.warning("group of delivery %s quarantined by %s: %s (%d trajectories)",
                        delivery_id, consumer, reason, trajectories)
        return int(done == 1)

    def _release(self, eid: str, consumer: str, reason: str, dropped: int) -> int:
        k = self.keys
        return int(self._scripts["RELEASE"](
            keys=[k.ready, k.stats, k.leases],
            args=[k.prefix, CONSUMER_GROUP, eid, consumer, reason, self.cfg.tombstone_seconds,
                  dropped]))

    # ---- policy version, timeouts, stats ----------------------------------------------------
    def publish_policy_version(self, version: int) -> int:
        """Raise the published policy version (never lowers it); returns the current one."""
        if version < 0:
            raise ValueError(f"version: {version} < 0")
        current = int(self._scripts["SET_MAX"](keys=[self.keys.policy_version], args=[version]))
        with self.version_changed:
            self.version_changed.notify_all()
        self._metric("r3flow_store_policy_version").set(current)
        return current

    def policy_version(self) -> int:
        return int(self.r.get(self.keys.policy_version) or 0)

    def start_run(self, run_id: str, version: int) -> RunFence:
        """A trainer starting or resuming `run_id` at `version`: the same run only raises the
        version; another run becomes the store's current one, starting above every version
        seen (docs/store.md, run fencing). Returns the run; its version is policy_version()."""
        if not run_id or len(run_id) > 128:
            raise ValueError(f"run_id: {run_id[:64]!r} must be 1-128 characters")
        if version < 0:
            raise ValueError(f"version: {version} < 0")
        before = self.run_fence()
        current, start = self._scripts["START_RUN"](
            keys=[self.keys.policy_version, self.keys.run], args=[run_id, version])
        fence = RunFence(run_id, int(start))
        if before != fence:
            log.warning("run %s starts at policy version %d (was %s): groups of other runs "
                        "are dropped `%s`", run_id, fence.start_version,
                        f"run {before.run_id}" if before else "no run", OTHER_RUN)
        with self.version_changed:
            self.version_changed.notify_all()
        self._metric("r3flow_store_policy_version").set(int(current))
        return fence

    def run_fence(self) -> RunFence | None:
        """The current run (None until a trainer started one)."""
        got = self.r.hmget(self.keys.run, ["id", "start"])
        return None if got[0] is None else RunFence(as_str(got[0]), int(got[1] or 0))

    def reap_timeouts(self, now: float | None = None) -> int:
        """Close groups incomplete for longer than group_timeout_seconds; returns how many."""
        cutoff = (now or time.time()) - self.cfg.group_timeout_seconds
        k, closed = self.keys, 0
        for gid in self.r.zrangebyscore(k.open_groups, "-inf", cutoff):
            dropped, _ = self._scripts["TIMEOUT"](
                keys=[k.open_groups, k.stats, k.ready],
                args=[k.prefix, gid, cutoff, self.cfg.tombstone_seconds,
                      self.cfg.group_timeout_policy])
            self._metric("r3flow_store_dropped_total", "group_timeout").inc(int(dropped))
            closed += 1
        return closed

    def stats(self) -> StatsSnapshot:
        """Durable counters from Redis plus the live ready/pending counts."""
        with self.r.pipeline(transaction=False) as p:
            p.hgetall(self.keys.stats)
            p.xlen(self.keys.ready)
            p.xpending(self.keys.ready, CONSUMER_GROUP)
            p.get(self.keys.policy_version)
            p.zcard(self.keys.open_groups)
            p.hmget(self.keys.run, ["id", "start"])
            raw, length, pending, pv, n_open, run = p.execute(raise_on_error=False)
        counters = {as_str(k): int(v) for k, v in raw.items()}
        n_pending = int(pending["pending"]) if isinstance(pending, dict) else 0
        snap = StatsSnapshot(counters, max(0, int(length) - n_pending), n_pending, int(pv or 0),
                             int(n_open or 0),
                             None if run[0] is None else RunFence(as_str(run[0]), int(run[1] or 0)))
        delivered = counters.get("delivered_tokens", 0)
        self._metric("r3flow_store_backlog_tokens").set(
            counters.get("backlog_tokens", 0) - delivered)
        self._metric("r3flow_store_unacked_tokens").set(delivered)
        self._metric("r3flow_store_groups_ready").set(snap.groups_ready)
        self._metric("r3flow_store_policy_version").set(snap.policy_version)
        return snap

