"""The append path: validate a whole client stream against stored state, then commit it.

Nothing of a stream is written unless every message in it validates (services/store/validate.py).
Each message is then committed by one Lua script (services/store/lua.py), all of a stream's
scripts in one pipeline, so a crash leaves Redis at a message boundary and a retried stream
only re-applies what is missing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis

from services.common.pb.r3flow.v1 import store_pb2
from services.store import lua, validate
from services.store.config import StoreConfig
from services.store.errors import CapacityError, RateLimit, SizeLimitError, is_redis_oom, redis_full
from services.store.keys import CONSUMER_GROUP, Keys
from services.store.routing_checks import RoutingChecks, in_context
from services.store.validate import GroupState, TrajState, Write

log = logging.getLogger(__name__)
MEMORY_INFO_MAX_AGE_S = 0.25  # Redis INFO memory reused for this long while far from full
# Redis memory a byte of AppendRequest may take (hash and stream overhead on small fields):
# bytes appended since the last INFO read count this many times toward "near the limit".
REDIS_BYTES_PER_REQUEST_BYTE = 3
REFUSAL_LOG_EVERY_S = 60.0  # a limit that keeps refusing begins is logged again this often

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


class Appender:
    """Validates and commits Append streams (see module docstring)."""

    def __init__(self, client: redis.Redis, config: StoreConfig, keys: Keys,
                 metric: Callable[..., Any]) -> None:
        self.r: Any = client  # redis-py's annotations mix sync and async replies
        self.cfg = config
        self.keys = keys
        self.limits = validate.Limits(
            config.max_tokens_per_trajectory, config.max_group_size,
            decode_routing=config.routing_validation == "decode",
            models=tuple((m.name, m.num_experts, m.top_k) for m in config.models))
        self._metric = metric
        self._memory: tuple[dict | None, float] = (None, 0.0)  # last INFO memory, when read
        self._refusals = RateLimit(REFUSAL_LOG_EVERY_S)
        self._appended_since_info = 0  # request bytes committed since that read
        if not self.limits.decode_routing:
            log.warning("routing_validation=header: routing ids are not range/duplicate "
                        "checked before they are stored")
        if not config.models:
            log.warning("models: none registered; routing of any num_experts/top-k is accepted")
        self._sha: dict[str, str] = {}
        self._load_scripts()

    def _load_scripts(self) -> None:
        # Append scripts run as EVALSHA inside pipelines: redis-py's Script objects would add a
        # SCRIPT EXISTS round trip to every pipeline.
        self._sha = {name: self.r.script_load(getattr(lua, name))
                     for name in ("BEGIN", "SEGMENT", "FINISH")}

    def append(self, requests: Iterable[store_pb2.AppendRequest],
               before_commit: Callable[[], None] | None = None) -> AppendResult:
        """Validate the whole stream, then commit it message by message (see module doc).
        `before_commit` may raise to stop a stream whose call broke off during validation."""
        try:
            writes, duplicates, stream_bytes = self._validate_stream(requests)
        except ValueError:
            self._metric("r3flow_store_rejections_total", "invalid_argument").inc()
            raise
        if before_commit is not None:
            before_commit()
        if self.cfg.redis_memory_reserve and any(isinstance(w, validate.BeginWrite)
                                                 for w in writes):
            self._check_memory()
        result = self._commit(writes)
        self._appended_since_info += stream_bytes
        result.duplicates += duplicates
        self._metric("r3flow_store_appends_total", "duplicate").inc(result.duplicates)
        return result

    def _validate_stream(self, requests: Iterable[store_pb2.AppendRequest]
                         ) -> tuple[list[Write], int, int]:
        """(writes, duplicates, the stream's bytes)."""
        reqs: list[store_pb2.AppendRequest] = []
        buffered = 0
        for req in requests:
            size = req.ByteSize()
            if size > self.cfg.max_message_bytes:
                self._metric("r3flow_store_rejections_total", "message_too_large").inc()
                raise SizeLimitError(
                    f"AppendRequest: {size} bytes > max_message_bytes="
                    f"{self.cfg.max_message_bytes} [trajectory_id={req.trajectory_id!r} "
                    f"sequence_number={req.sequence_number}]")
            buffered += size
            if buffered > self.cfg.max_stream_bytes:
                raise ValueError(f"stream: over max_stream_bytes={self.cfg.max_stream_bytes}; "
                                 "send fewer trajectories per Append stream")
            reqs.append(req)
        states, groups = self._prefetch(reqs)
        pending = RoutingChecks(self.cfg.routing_check_threads)
        try:
            writes = self._validate_each(reqs, states, groups, pending)
        except ValueError:
            pending.raise_first()  # a routing payload error earlier in the stream wins
            raise
        pending.raise_first()
        return writes, len(reqs) - len(writes), buffered

    def _validate_each(self, reqs: list[store_pb2.AppendRequest], states: dict[str, TrajState],
                       groups: dict[str, GroupState], pending: RoutingChecks) -> list[Write]:
        """Every check but the routing payload walks, which go to `pending`."""
        writes: list[Write] = []
        for req in reqs:
            try:
                write = self._validate_one(req, states, groups, pending)
            except ValueError as e:
                raise in_context(e, req) from None
            if write is not None:
                writes.append(write)
        return writes

    def _validate_one(self, req: store_pb2.AppendRequest, states: dict[str, TrajState],
                      groups: dict[str, GroupState], pending: RoutingChecks) -> Write | None:
        kind = validate.check_envelope(req)
        state = states[req.trajectory_id]
        if not validate.check_order(req, state):
            return None
        write: Write
        if kind == "begin":
            group = self._group_of(req.begin.group_id, groups)
            write = validate.validate_begin(req, group, self.limits)
            group.size, group.members = write.group_size, group.members + 1
        elif kind == "segment":
            group = self._group_of(state.group_id, groups) if req.sequence_number == 1 \
                else GroupState()
            write = validate.validate_segment(req, state, self.limits, group.validated_prompts,
                                              pending)
            if write.prompt_field:
                group.validated_prompts.add(write.prompt_field)
                if write.prompt_field in group.stored_prompts:
                    write.prompt_chunk = b""  # already in Redis: don't send it again
        else:
            write = validate.validate_finish(req, state)
        validate.advance(state, write)
        return write

    def _prefetch(self, reqs: list[store_pb2.AppendRequest]
                  ) -> tuple[dict[str, TrajState], dict[str, GroupState]]:
        """Stored state of every trajectory and group the stream names: two round trips."""
        tids = list(dict.fromkeys(r.trajectory_id for r in reqs))
        with self.r.pipeline(transaction=False) as p:
            for tid in tids:
                p.hmget(self.keys.traj(tid), _STATE_FIELDS)
                p.exists(self.keys.traj_done(tid))
            replies = p.execute()
        states = {tid: _parse_state(*replies[2 * i:2 * i + 2]) for i, tid in enumerate(tids)}
        gids = {r.begin.group_id for r in reqs if r.WhichOneof("body") == "begin"}
        gids |= {st.group_id for st in states.values() if st.group_id}
        return states, self._load_groups(sorted(gids))

    def _group_of(self, gid: str, groups: dict[str, GroupState]) -> GroupState:
        if gid not in groups:
            groups.update(self._load_groups([gid]))
        return groups[gid]

    def _load_groups(self, gids: list[str]) -> dict[str, GroupState]:
        if not gids:
            return {}
        with self.r.pipeline(transaction=False) as p:
            for gid in gids:
                p.hget(self.keys.group(gid), "size")
                p.scard(self.keys.group_members(gid))
                p.exists(self.keys.group_done(gid))
                p.hkeys(self.keys.group(gid))
            replies = p.execute()
        return {gid: _parse_group(*replies[4 * i:4 * i + 4]) for i, gid in enumerate(gids)}

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

    def _queue_write(self, p: Any, w: Write) -> None:
        k, tid = self.keys, w.trajectory_id
        if isinstance(w, validate.BeginWrite):
            keys = [k.traj(tid), k.traj_done(tid), k.group(w.group_id),
                    k.group_members(w.group_id), k.group_done(w.group_id), k.stats,
                    k.open_groups, k.ready]
            args = [tid, w.header, w.group_size, w.prompt_len, self.cfg.max_backlog_tokens,
                    self.cfg.max_inflight_trajectories, time.time(), w.group_id,
                    self.cfg.max_groups_ahead or 0, CONSUMER_GROUP]
            p.evalsha(self._sha["BEGIN"], len(keys), *keys, *args)
        elif isinstance(w, validate.SegmentWrite):
            gid = w.group_id
            keys = [k.traj(tid), k.traj_done(tid), k.group(gid), k.stats]
            args = [w.seq, w.start_row, w.rows, w.tokens, w.head, w.policy_version,
                    w.layout.encode(), w.prompt_field, w.prompt_chunk, w.part, w.open_rows,
                    *w.chunks]
            p.evalsha(self._sha["SEGMENT"], len(keys), *keys, *args)
        else:
            gid = w.group_id
            keys = [k.traj(tid), k.traj_done(tid), k.group(gid), k.stats, k.ready,
                    k.open_groups]
            args = [w.seq, w.payload, w.num_segments, int(w.aborted), gid]
            p.evalsha(self._sha["FINISH"], len(keys), *keys, *args)

    def _account(self, w: Write, reply: object, result: AppendResult) -> None:
        if isinstance(reply, redis.ResponseError) and is_redis_oom(reply):
            self._metric("r3flow_store_rejections_total", "redis_full").inc()
            raise redis_full(f"append [trajectory_id={w.trajectory_id!r} sequence_number="
                             f"{w.seq}]", self.r.info("memory"), self.cfg.backpressure_retry_ms)
        if isinstance(reply, Exception):
            raise reply
        code = (reply[0] if isinstance(reply, list) else reply).decode()  # type: ignore[union-attr]
        if code == "dup":
            result.duplicates += 1
            return
        if code in _LIMITS:
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
        elif isinstance(w, validate.FinishWrite) and w.aborted:
            self._metric("r3flow_store_dropped_total", "aborted").inc()

    def _check_memory(self) -> None:
        """Refuse new trajectories once Redis is within `redis_memory_reserve` of its
        maxmemory: the reserve is what open trajectories finish into and what pulls and acks
        (which free memory) write their leases into; at maxmemory itself they would fail too."""
        mem = self._memory_info()
        limit = int(mem.get("maxmemory", 0))
        if limit and int(mem["used_memory"]) >= limit * (1 - self.cfg.redis_memory_reserve):
            self._metric("r3flow_store_rejections_total", "redis_full").inc()
            raise redis_full(f"begin (store redis_memory_reserve="
                             f"{self.cfg.redis_memory_reserve})", mem,
                             self.cfg.backpressure_retry_ms)

    def _memory_info(self) -> dict:
        """INFO memory, re-read on every begin near the limit (used_memory, plus what was
        appended since the read, above (1 - 2 x reserve) x maxmemory), else at most every
        MEMORY_INFO_MAX_AGE_S: one INFO round trip per Append stream cost the store and Redis
        a fifth more CPU per trajectory (issue 34). Counting the appended bytes keeps a burst
        within one read's age from running past the reserve into Redis's own OOM."""
        mem, at = self._memory
        now = time.monotonic()
        if mem is None or now - at > MEMORY_INFO_MAX_AGE_S or self._near_limit(mem):
            mem = self.r.info("memory")
            self._memory = (mem, now)
            self._appended_since_info = 0
        return mem

    def _near_limit(self, mem: dict) -> bool:
        limit = int(mem.get("maxmemory", 0))
        if not limit:
            return False
        estimate = int(mem["used_memory"]) + (
            REDIS_BYTES_PER_REQUEST_BYTE * self._appended_since_info)
        return estimate >= limit * (1 - 2 * self.cfg.redis_memory_reserve)

    def _refuse(self, code: str) -> None:
        self._metric("r3flow_store_rejections_total", code).inc()
        limit = _LIMITS[code]
        message = f"begin: store over {limit}={getattr(self.cfg, limit)} ({self._held()})"
        if self._refusals.due(limit):  # then once a minute; every refusal is counted
            log.warning("appends refused: %s; the rollout workers wait and retry", message)
        raise CapacityError(f"{message}; retry later", reason=code,
                            retry_after_ms=self.cfg.backpressure_retry_ms)

    def _held(self) -> str:
        """What the store holds, for a refusal's message: the budget's numbers."""
        with self.r.pipeline(transaction=False) as p:
            p.hmget(self.keys.stats, "backlog_tokens", "delivered_tokens", "inflight")
            p.zcard(self.keys.open_groups)
            (backlog, delivered, inflight), n_open = p.execute()
        backlog, delivered = int(backlog or 0), int(delivered or 0)
        return (f"held: {backlog - delivered} tokens undelivered, {delivered} delivered and not "
                f"yet acked (max_unacked_tokens={self.cfg.max_unacked_tokens}), "
                f"{int(inflight or 0)} trajectories in flight, {n_open} groups open")


# Lua refusal code -> the StoreConfig limit it enforces (RESOURCE_EXHAUSTED, retry later).
_LIMITS = {"backlog": "max_backlog_tokens", "inflight": "max_inflight_trajectories",
           "groups_ahead": "max_groups_ahead"}

_STATE_FIELDS = ("next", "state", "plen", "rows", "tokens", "nseg", "layout", "gid", "part",
                 "orows")


def _parse_state(fields: list[bytes | None], tombstone: int) -> TrajState:
    nxt, st, plen, rows, tokens, nseg, layout, gid, part, orows = fields
    if nxt is None:
        return TrajState(done=bool(tombstone))
    return TrajState(next_seq=int(nxt), done=st != b"open", prompt_len=int(plen),  # type: ignore[arg-type]
                     rows=int(rows), tokens=int(tokens), num_segments=int(nseg),  # type: ignore[arg-type]
                     layout=validate.Layout.decode(layout.decode()) if layout else None,
                     group_id=gid.decode(), part=int(part or 0),  # type: ignore[union-attr]
                     open_rows=int(orows or 0))


def _parse_group(size: bytes | None, members: int, done: int, fields: list[bytes]) -> GroupState:
    # A prompt field in Redis stays there while any member trajectory exists.
    prompts = {f.decode() for f in fields if f.startswith(b"p:")}
    return GroupState(size=int(size or 0), members=int(members), closed=bool(done),
                      stored_prompts=prompts, validated_prompts=set(prompts))
