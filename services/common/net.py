"""Ports for servers a process starts and then names to its children or peers.

A port the kernel hands out for bind(0) comes from the ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range), the same range every outgoing connection takes its
local port from: between the pick and the server's own bind, a gRPC or Redis client on the box
can take it ("Address already in use" in CI). So `free_port` picks, at random, a port below
that range that binds now; only another picker can race it (1 in ~12,000 a pair). A process
does not hand out a port twice while the range has others (two picks in a row, before either
server bound, cannot collide), and R3FLOW_PORT_RANGE=LO-HI narrows the range for a process and
its children: pytest-xdist workers each take their own part (tests/conftest.py), so pickers of
different workers cannot race at all.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 20000  # above the well-known and most registered service ports
TRIES = 50
RANGE_ENV = "R3FLOW_PORT_RANGE"
_handed: set[int] = set()  # ports this process handed out: not again while others are left


def ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        return int(PORT_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_range() -> range:
    """The ports free_port picks from: R3FLOW_PORT_RANGE (LO-HI, both inclusive) when set, else
    LOWEST_PORT up to the ephemeral range."""
    spec = os.environ.get(RANGE_ENV)
    if not spec:
        return range(LOWEST_PORT, ephemeral_low())
    try:
        lo, hi = (int(v) for v in spec.split("-"))
    except ValueError:
        raise ValueError(f"{RANGE_ENV}={spec!r}: expected LO-HI, two port numbers") from None
    if not 1024 <= lo <= hi <= 65535:
        raise ValueError(f"{RANGE_ENV}={spec!r}: expected 1024 <= LO <= HI <= 65535")
    return range(lo, hi + 1)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that binds now and that outgoing connections do not take."""
    below = port_range()
    if below:
        if len(_handed) > len(below) // 2:
            _handed.clear()
        picks = random.sample(below, min(TRIES, len(below)))
        for port in sorted(picks, key=_handed.__contains__):  # not handed out before first
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                _handed.add(port)
                return port
    with socket.socket() as s:  # no room below the range (or all taken): the kernel's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])
