"""Sender side: who is alive. Reads the receivers' heartbeats and error reports so that a
failed push names the member that caused it rather than the one that noticed it."""

from __future__ import annotations

import time

import torch.distributed as dist

from services.common.weight_sync.group import Keys, Member, WeightSyncError


class MemberMonitor:
    """Tracks when each member's heartbeat last changed (on the sender's own clock)."""

    def __init__(self, store: dist.Store, members: list[Member], version: int,
                 heartbeat_timeout_s: float) -> None:
        self.store, self.members, self.version = store, members, version
        self.timeout_s = heartbeat_timeout_s
        now = time.monotonic()
        self._seen: dict[int, tuple[bytes, float]] = {m.rank: (b"", now) for m in members}

    def stale(self) -> list[Member]:
        """Members whose heartbeat has not moved for `heartbeat_timeout_s`."""
        now = time.monotonic()
        keys = [Keys.hb(m.rank) for m in self.members]
        if self.store.check(keys):
            values = self.store.multi_get(keys)
        else:  # get waits for a key: a member not joined yet has none (no beat, since start)
            values = [self.store.get(k) if self.store.check([k]) else b"" for k in keys]
        out = []
        for m, value in zip(self.members, values, strict=True):
            last, since = self._seen[m.rank]
            if value != last:
                self._seen[m.rank] = (value, now)
            elif now - since > self.timeout_s:
                out.append(m)
        return out

    def progress(self) -> dict[Member, int]:
        """Buckets verified so far by each member (from its last heartbeat)."""
        return {m: int(self._seen[m.rank][0].split(b":")[-1] or 0) for m in self.members}

    def reported(self) -> list[tuple[Member, str]]:
        """Members that posted an error, with their reason."""
        if self.store.add(Keys.ERRORS, 0) == 0:
            return []
        return [(m, self.store.get(Keys.err(m.rank)).decode()) for m in self.members
                if self.store.check([Keys.err(m.rank)])]

    def check(self) -> None:
        """Raise a WeightSyncError naming the culprit if any member is dead or failing."""
        stale = self.stale()
        if stale:
            raise self.blame(stale, "no heartbeat for "
                              f"{self.timeout_s:.1f} s (dead or stalled)")
        if self.reported():
            raise self.diagnose("a member reported an error")

    def diagnose(self, cause: str) -> WeightSyncError:
        """After a failure: wait up to a heartbeat timeout for a dead member to show (its
        neighbours' transport errors arrive first), else blame the members that reported."""
        deadline = time.monotonic() + self.timeout_s + 0.5
        while time.monotonic() < deadline:
            stale = self.stale()
            if stale:
                return self.blame(stale, f"no heartbeat (dead or stalled); {cause}")
            time.sleep(0.05)
        reported = self.reported()
        if reported:
            reasons = "; ".join(f"{m}: {why}" for m, why in reported)
            return self.blame([m for m, _ in reported], reasons)
        return WeightSyncError(f"weight push v{self.version} failed: {cause}",
                               version=self.version)

    def blame(self, members: list[Member], why: str) -> WeightSyncError:
        """A WeightSyncError that names `members`."""
        names = tuple(str(m) for m in members)
        return WeightSyncError(f"weight push v{self.version} failed: member(s) "
                               f"{', '.join(names)}: {why}", version=self.version, members=names)
