"""Leases on delivered groups: the store's lease clock, the leases-hash value, who pulls and
what is delivered, and the delivery id a client names a group by (services/store/core.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Puller:
    consumer: str
    session: str = ""


@dataclass(frozen=True)
class Entry:
    """A stream entry being delivered: its id, delivery count, and whether it is its holder's
    own renewal."""

    eid: str
    count: int
    renewed: bool = False


def parse_lease(value: bytes | None, default_ms: int) -> tuple[int, str]:
    """A leases-hash value `<lease ms>[|<session>]` -> (lease ms, session)."""
    if not value:
        return default_ms, ""
    ms, _, session = as_str(value).partition("|")
    return int(ms), session


def check_delivery_id(eid: str, field: str) -> None:
    """A delivery id is a Redis stream entry id `<ms>-<seq>` (u64 each); Redis would answer
    anything else with an error that is ours to report as bad input, not INTERNAL."""
    ms, dash, seq = eid.partition("-")
    if not (dash and ms.isdigit() and seq.isdigit() and ms.isascii() and seq.isascii()
            and int(ms) < 2**64 and int(seq) < 2**64):
        raise ValueError(f"{field}: {eid[:64]!r} is not a delivery id (<ms>-<seq>)")


class LeaseClock:
    """The store's clock for leases, kept as an offset to Redis' own: a lease taken when the
    clock stood `ahead_ms` ahead lasts its length plus that offset in Redis' idle time (the
    leases hash records the sum), and it has run out once a pending entry's idle time plus
    today's offset reaches it. A running store never moves it (offset 0: Redis' idle times
    alone); tests `advance` it instead of sleeping a lease out."""

    def __init__(self) -> None:
        self.ahead_ms = 0

    def advance(self, seconds: float) -> None:
        """Move the store's time forward by `seconds` (leases run out as if they had passed)."""
        self.ahead_ms += round(1000 * seconds)


def as_str(value: bytes | str) -> str:
    """A Redis reply's bytes (or str) as str."""
    return value.decode() if isinstance(value, bytes) else value
