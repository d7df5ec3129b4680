"""TrajectoryStoreCore: the store's logic over a Redis client, with no gRPC in sight.

Append: a whole client stream is validated against the stored state before its first message
is committed; each message is then committed by one Lua script (services/store/lua.py), so a
crash leaves Redis at a message boundary and a retried stream only re-applies what is missing.
Pull/ack: complete groups are entries of a Redis Stream read by one consumer group; a pull
first claims entries whose lease expired, then reads new ones.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import redis
from prometheus_client import CollectorRegistry

from services.common.metrics import create_metrics
from services.common.pb.r3flow.v1 import store_pb2
from services.store import lua, validate
from services.store.assemble import Delivery, assemble_group
from services.store.config import StoreConfig
from services.store.errors import CapacityError
from services.store.keys import CONSUMER_GROUP, Keys
from services.store.validate import GroupState, TrajState, Write

log = logging.getLogger(__name__)

_COMMIT_ERRORS = {  # Lua result -> (field, meaning) for writes that lost a race
    "group_size": "begin.group_size: group size changed concurrently",
    "group_full": "begin.group_id: group filled up concurrently",
    "group_done": "begin.group_id: group was released or dropped",
    "gap": "sequence_number: earlier messages of this trajectory are missing",
    "missing": "sequence_number: trajectory has no stored begin",
    "conflict": "sequence_number: trajectory changed concurrently (another stream wrote it)",
}


@dataclass
class AppendResult:
    accepted: int = 0
    duplicates: int = 0
    policy_version: int = 0


@dataclass
class StatsSnapshot:
    counters: dict[str, int] = field(default_factory=dict)
    groups_ready: int = 0
    groups_pending: int = 0
    policy_version: int = 0

    def dropped_by_reason(self) -> dict[str, int]:
        return {k.removeprefix("dropped:"): v for k, v in self.counters.items()
                if k.startswith("dropped:")}


class TrajectoryStoreCore:
    """Append, pull, ack, policy version and stats over one Redis (see module docstring)."""

    def __init__(self, client: redis.Redis, config: StoreConfig,
                 registry: CollectorRegistry | None = None) -> None:
        self.r = client
        self.cfg = config
        self.keys = Keys(config.key_prefix)
        self.limits = validate.Limits(config.max_tokens_per_trajectory, config.max_group_size)
        self.metrics = create_metrics(registry or CollectorRegistry(), "store")
        self.version_changed = threading.Condition()
        self._scripts = {name: client.register_script(getattr(lua, name)) for name in
                         ("RELEASE", "TIMEOUT", "SET_MAX")}
        self._sha: dict[str, str] = {}
        self._load_scripts()
        self.ensure_stream()

    def _load_scripts(self) -> None:
        # Append scripts run as EVALSHA inside pipelines: redis-py's Script objects would add a
        # SCRIPT EXISTS round trip to every pipeline.
        self._sha = {name: self.r.script_load(getattr(lua, name))
                     for name in ("BEGIN", "SEGMENT", "FINISH")}

    # ---- setup -------------------------------------------------------------------------
    def ensure_stream(self) -> None:
        """Create the ready stream and its consumer group if Redis does not have them."""
        try:
            self.r.xgroup_create(self.keys.ready, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def _metric(self, name: str, *labels: str):  # noqa: ANN202 (prometheus child type)
        m = self.metrics[name]
        return m.labels(*labels) if labels else m

    # ---- append ------------------------------------------------------------------------
    def append(self, requests: Iterable[store_pb2.AppendRequest]) -> AppendResult:
        """Validate the whole stream, then commit it message by message (see module doc)."""
        try:
            writes, duplicates = self._validate_stream(requests)
        except ValueError:
            self._metric("r3flow_store_rejections_total", "invalid_argument").inc()
            raise
        result = self._commit(writes)
        result.duplicates += duplicates
        self._metric("r3flow_store_appends_total", "duplicate").inc(result.duplicates)
        result.policy_version = self.policy_version()
        return result

    def _validate_stream(self, requests: Iterable[store_pb2.AppendRequest]
                         ) -> tuple[list[Write], int]:
        states: dict[str, TrajState] = {}
        groups: dict[str, GroupState] = {}
        writes: list[Write] = []
        duplicates = buffered = 0
        for req in requests:
            buffered += req.ByteSize()
            if buffered > self.cfg.max_stream_bytes:
                raise ValueError(f"stream: over max_stream_bytes={self.cfg.max_stream_bytes}; "
                                 "send fewer trajectories per Append stream")
            try:
                write = self._validate_one(req, states, groups)
            except ValueError as e:
                raise ValueError(f"{e} [trajectory_id={req.trajectory_id!r} "
                                 f"sequence_number={req.sequence_number}]") from None
            if write is None:
                duplicates += 1
            else:
                writes.append(write)
        return writes, duplicates

    def _validate_one(self, req: store_pb2.AppendRequest, states: dict[str, TrajState],
                      groups: dict[str, GroupState]) -> Write | None:
        kind = validate.check_envelope(req)
        state = states.get(req.trajectory_id) or self._load_state(req.trajectory_id)
        states[req.trajectory_id] = state
        if not validate.check_order(req, state):
            return None
        write: Write
        if kind == "begin":
            group = self._group_of(req.begin.group_id, groups)
            write = validate.validate_begin(req, group, self.limits)
            group.size, group.members = write.group_size, group.members + 1
        elif kind == "segment":
            group = self._group_of(state, groups) if req.sequence_number == 1 else GroupState()
            write = validate.validate_segment(req, state, self.limits, group.validated_prompts)
            if write.prompt_field:
                group.validated_prompts.add(write.prompt_field)
                if write.prompt_field in group.stored_prompts:
                    write.prompt_chunk = b""  # already in Redis: don't send it again
        else:
            write = validate.validate_finish(req, state)
        validate.advance(state, write)
        return write

    def _load_state(self, tid: str) -> TrajState:
        fields = ("next", "state", "plen", "rows", "tokens", "nseg", "layout", "gid")
        with self.r.pipeline(transaction=False) as p:
            p.hmget(self.keys.traj(tid), fields)
            p.exists(self.keys.traj_done(tid))
            (nxt, st, plen, rows, tokens, nseg, layout, gid), tomb = p.execute()
        if nxt is None:
            return TrajState(done=bool(tomb))
        return TrajState(next_seq=int(nxt), done=st != b"open", prompt_len=int(plen),
                         rows=int(rows), tokens=int(tokens), num_segments=int(nseg),
                         layout=validate.Layout.decode(layout.decode()) if layout else None,
                         group_id=gid.decode())

    def _group_of(self, ref: TrajState | str, groups: dict[str, GroupState]) -> GroupState:
        gid = ref.group_id if isinstance(ref, TrajState) else ref
        if gid not in groups:
            groups[gid] = self._load_group(gid)
        return groups[gid]

    def _load_group(self, gid: str) -> GroupState:
        with self.r.pipeline(transaction=False) as p:
            p.hget(self.keys.group(gid), "size")
            p.scard(self.keys.group_members(gid))
            p.exists(self.keys.group_done(gid))
            p.hkeys(self.keys.group(gid))
            size, members, done, fields = p.execute()
        # A prompt field in Redis stays there while any member trajectory exists.
        prompts = {f.decode() for f in fields if f.startswith(b"p:")}
        return GroupState(size=int(size or 0), members=int(members), closed=bool(done),
                          stored_prompts=prompts, validated_prompts=set(prompts))

    def _commit(self, writes: list[Write]) -> AppendResult:
        result = AppendResult()
        # One pipeline: a stream's scripts cost one round trip. A refused begin makes the
        # scripts after it answer 'missing'; the first error is raised, the rest are no-ops
        # or valid writes that a retry sees as duplicates.
        for _ in range(2):
            with self.r.pipeline(transaction=False) as p:
                for w in writes:
                    self._queue_write(p, w)
                replies = p.execute(raise_on_error=False)
            if not any(isinstance(x, redis.exceptions.NoScriptError) for x in replies):
                break
            # Redis restarted and lost its script cache; re-running is safe (idempotent).
            self._load_scripts()
        for w, reply in zip(writes, replies, strict=True):
            self._account(w, reply, result)
        return result

    def _queue_write(self, p: redis.client.Pipeline, w: Write) -> None:
        k, tid = self.keys, w.trajectory_id
        if isinstance(w, validate.BeginWrite):
            keys = [k.traj(tid), k.traj_done(tid), k.group(w.group_id),
                    k.group_members(w.group_id), k.group_done(w.group_id), k.stats,
                    k.open_groups]
            args = [tid, w.header, w.group_size, w.prompt_len, self.cfg.max_backlog_tokens,
                    self.cfg.max_inflight_trajectories, time.time(), w.group_id]
            p.evalsha(self._sha["BEGIN"], len(keys), *keys, *args)
        elif isinstance(w, validate.SegmentWrite):
            gid = w.group_id
            keys = [k.traj(tid), k.traj_done(tid), k.group(gid), k.stats]
            args = [w.seq, w.start_row, w.rows, w.tokens, w.payload, w.policy_version,
                    w.layout.encode(), w.prompt_field, w.prompt_chunk]
            p.evalsha(self._sha["SEGMENT"], len(keys), *keys, *args)
        else:
            gid = w.group_id
            keys = [k.traj(tid), k.traj_done(tid), k.group(gid), k.stats, k.ready,
                    k.open_groups]
            args = [w.seq, w.payload, w.num_segments, int(w.aborted), gid]
            p.evalsha(self._sha["FINISH"], len(keys), *keys, *args)

    def _account(self, w: Write, reply: object, result: AppendResult) -> None:
        if isinstance(reply, Exception):
            raise reply
        code = (reply[0] if isinstance(reply, list) else reply).decode()  # type: ignore[union-attr]
        if code == "dup":
            result.duplicates += 1
            return
        if code in ("backlog", "inflight"):
            self._refuse(code)
        if code != "ok":
            raise ValueError(f"{_COMMIT_ERRORS[code]} [trajectory_id={w.trajectory_id!r} "
                             f"sequence_number={w.seq}]")
        result.accepted += 1
        kind = {validate.BeginWrite: "begin", validate.SegmentWrite: "segment"}.get(
            type(w), "finish")
        self._metric("r3flow_store_appends_total", kind).inc()
        if isinstance(w, validate.SegmentWrite):
            new_prompt = int(reply[1])  # type: ignore[index]
            encoded = w.encoded_bytes + (len(w.prompt_chunk) if new_prompt else 0)
            self._metric("r3flow_store_routing_raw_bytes_total").inc(w.raw_bytes)
            self._metric("r3flow_store_routing_encoded_bytes_total").inc(encoded)

    def _refuse(self, code: str) -> None:
        self._metric("r3flow_store_rejections_total", code).inc()
        limit = "max_backlog_tokens" if code == "backlog" else "max_inflight_trajectories"
        value = getattr(self.cfg, limit)
        raise CapacityError(f"begin: store over {limit}={value}; retry later", reason=code,
                            retry_after_ms=self.cfg.backpressure_retry_ms)

    # ---- pull / ack ----------------------------------------------------------------------
    def pull(self, consumer: str, max_groups: int, lease_seconds: int = 0,
             wait_ms: int = 0) -> list[Delivery]:
        """Up to `max_groups` complete groups, leased to `consumer` (expired leases first)."""
        if not consumer:
            raise ValueError("consumer: required (names the lease holder)")
        if max_groups < 1:
            raise ValueError(f"max_groups: {max_groups} < 1")
        t0 = time.perf_counter()
        try:
            out = self._pull(consumer, max_groups, lease_seconds, wait_ms)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self.ensure_stream()  # Redis lost its data (no AOF): start a fresh stream
            out = []
        self._metric("r3flow_store_pull_seconds").observe(time.perf_counter() - t0)
        return out

    def _pull(self, consumer: str, max_groups: int, lease_seconds: int,
              wait_ms: int) -> list[Delivery]:
        lease_ms = 1000 * (lease_seconds or self.cfg.lease_seconds)
        block = min(wait_ms, self.cfg.max_wait_ms) or None
        out: list[Delivery] = []
        while len(out) < max_groups:
            entries = self._claim_expired(consumer, max_groups - len(out))
            entries += self._read_new(consumer, max_groups - len(out) - len(entries),
                                      None if entries else block)
            if not entries:
                break
            block = None  # only the first read waits
            self._set_leases(entries, lease_ms)
            out += [d for d in (self._deliver(e) for e in entries) if d is not None]
        return out

    def _claim_expired(self, consumer: str, count: int) -> list[tuple[str, int]]:
        pending = self.r.xpending_range(self.keys.ready, CONSUMER_GROUP, "-", "+",
                                        max(100, 4 * count), idle=1000)
        if not pending:
            return []
        leases = self.r.hmget(self.keys.leases, [p["message_id"] for p in pending])
        claimed: list[tuple[str, int]] = []
        for p, lease in zip(pending, leases, strict=True):
            lease_ms = int(lease or 1000 * self.cfg.lease_seconds)
            if len(claimed) >= count or p["time_since_delivered"] < lease_ms:
                continue
            # XCLAIM re-checks the idle time, so two pullers never both win one entry.
            got = self.r.xclaim(self.keys.ready, CONSUMER_GROUP, consumer, lease_ms,
                                [p["message_id"]], justid=True)
            if got:
                claimed.append((_s(got[0]), int(p["times_delivered"]) + 1))
        if claimed:
            self.r.hincrby(self.keys.stats, "redeliveries", len(claimed))
            self._metric("r3flow_store_redeliveries_total").inc(len(claimed))
        return claimed

    def _read_new(self, consumer: str, count: int, block_ms: int | None
                  ) -> list[tuple[str, int]]:
        if count <= 0:
            return []
        reply = self.r.xreadgroup(CONSUMER_GROUP, consumer, {self.keys.ready: ">"},
                                  count=count, block=block_ms)
        entries = [(_s(eid), 1) for _, msgs in (reply or []) for eid, _ in msgs]
        if entries:
            self.r.hincrby(self.keys.stats, "groups_delivered", len(entries))
        return entries

    def _set_leases(self, entries: list[tuple[str, int]], lease_ms: int) -> None:
        self.r.hset(self.keys.leases, mapping={eid: lease_ms for eid, _ in entries})

    def _deliver(self, entry: tuple[str, int]) -> Delivery | None:
        eid, count = entry
        found = self.r.xrange(self.keys.ready, eid, eid)
        if not found:
            return None
        gid = _s(found[0][1][b"g"])
        d = assemble_group(self.r, self.keys, gid, eid, count)
        reason = self._drop_reason(d)
        if reason:
            n = 0 if d is None else len(d.trajectories)
            self._release(eid, "", reason, n)
            self._metric("r3flow_store_dropped_total", reason).inc(n)
            log.info("dropped group %s (%s, %d trajectories)", gid, reason, n)
            return None
        return d

    def _drop_reason(self, d: Delivery | None) -> str:
        if d is None:
            log.error("ready group has no payload in Redis; dropping its stream entry")
            return "missing"
        if not d.trajectories:
            return "aborted"  # every member aborted; counted when they finished
        lag = self.cfg.max_policy_lag
        if lag is not None and self.policy_version() - d.min_policy_version > lag:
            return "stale"
        return ""

    def ack(self, consumer: str, delivery_ids: Iterable[str]) -> int:
        """Ack delivered groups held by `consumer` and delete their payloads; returns count."""
        acked = 0
        for eid in delivery_ids:
            done = self._release(eid, consumer, "acked", 0)
            if done == -1:
                self._metric("r3flow_store_rejections_total", "ack_not_lease_holder").inc()
            acked += done == 1
        self._metric("r3flow_store_groups_acked_total").inc(acked)
        return acked

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
            raw, length, pending, pv = p.execute(raise_on_error=False)
        counters = {_s(k): int(v) for k, v in raw.items()}
        n_pending = int(pending["pending"]) if isinstance(pending, dict) else 0
        snap = StatsSnapshot(counters, max(0, int(length) - n_pending), n_pending, int(pv or 0))
        self._metric("r3flow_store_backlog_tokens").set(counters.get("backlog_tokens", 0))
        self._metric("r3flow_store_groups_ready").set(snap.groups_ready)
        self._metric("r3flow_store_policy_version").set(snap.policy_version)
        return snap


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
