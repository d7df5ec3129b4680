"""Errors the store maps to gRPC codes: ValueError -> INVALID_ARGUMENT, these -> others."""

from __future__ import annotations

import threading
import time


class CapacityError(Exception):
    """A limit that clears with time (backlog, in-flight trajectories): RESOURCE_EXHAUSTED."""

    def __init__(self, message: str, *, reason: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_ms = retry_after_ms


class UnackedFull(RuntimeError):
    """A pull the store refused because trainers hold max_unacked_tokens of delivered, not yet
    acked groups (StoreClient.pull raises it at once, unretried): the puller acks what it
    trained (a trainer: an early checkpoint) and pulls again."""


class SizeLimitError(Exception):
    """A message over a configured size: RESOURCE_EXHAUSTED without a retry hint (never retry)."""


class ChunkMissing(RuntimeError):
    """A chunk of a group being streamed is gone from Redis (the group was released meanwhile):
    the pull ends ABORTED and the client pulls again."""


class StreamCutShort(Exception):
    """An Append stream that ended before its client closed it (CANCELLED; nothing of it is
    committed)."""


def is_redis_oom(exc: BaseException) -> bool:
    """Redis refused a write at its maxmemory (a plain command's OutOfMemoryError, or the same
    error raised from inside a Lua script, which redis-py reports as a ResponseError)."""
    return "command not allowed when used memory" in str(exc)


def redis_full(what: str, memory: dict, retry_after_ms: int) -> CapacityError:
    """The refusal for a write Redis denied with OOM (maxmemory reached, policy noeviction):
    the Lua script it hit did not run (Redis denies a script at its first write), so nothing
    of the message was stored; or the store's own check that keeps a reserve below maxmemory.
    `memory` is Redis's INFO memory section."""
    used, limit = memory.get("used_memory", "?"), memory.get("maxmemory", "?")
    policy = memory.get("maxmemory_policy", "?")
    return CapacityError(
        f"{what}: Redis is full (used_memory {used} B of maxmemory {limit} B, "
        f"maxmemory-policy {policy}); nothing was stored. Trainers acking groups free memory; "
        f"otherwise lower store max_backlog_tokens or raise Redis maxmemory (chart: "
        f"redis.maxmemory); retry later", reason="redis_full", retry_after_ms=retry_after_ms)


class RateLimit:
    """Whether a message about `key` is due: the first time, then at most every `every_s`
    (a refusal that repeats is logged once a minute, not once a retry)."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def due(self, key: str) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -self.every_s) < self.every_s:
                return False
            self._last[key] = now
            return True
