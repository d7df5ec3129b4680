"""Ports for servers a process starts and then names to its children or peers.

A port the kernel hands out for bind(0) comes from the ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range), the same range every outgoing connection takes its
local port from: between the pick and the server's own bind, a gRPC or Redis client on the box
can take it ("Address already in use" in CI). So `free_port` picks, at random, a port below
that range that binds now; only another picker can race it (1 in ~12,000 a pair).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 20000  # above the well-known and most registered service ports
TRIES = 50


def ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        return int(PORT_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that binds now and that outgoing connections do not take."""
    below = range(LOWEST_PORT, ephemeral_low())
    if below:
        for port in random.sample(below, min(TRIES, len(below))):
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # no room below the range (or all taken): the kernel's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])
