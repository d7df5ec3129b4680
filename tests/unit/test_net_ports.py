"""services.common.net.free_port: a port that binds now, taken below the kernel's ephemeral
range (where outgoing connections take their local ports from), else the kernel's pick."""

from __future__ import annotations

import socket

import pytest

from services.common import net


def test_port_is_below_the_ephemeral_range_and_binds(monkeypatch) -> None:
    monkeypatch.delenv(net.RANGE_ENV, raising=False)  # a pytest-xdist worker's part
    low = net.ephemeral_low()
    for _ in range(20):
        port = net.free_port()
        assert net.LOWEST_PORT <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: it binds


def test_a_taken_port_is_not_handed_out(monkeypatch) -> None:
    monkeypatch.delenv(net.RANGE_ENV, raising=False)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        # a range of two ports, one held: only the other may come back
        monkeypatch.setattr(net, "LOWEST_PORT", taken - 1)
        monkeypatch.setattr(net, "ephemeral_low", lambda: taken + 1)
        with socket.socket() as probe:
            free_below = probe.connect_ex(("127.0.0.1", taken - 1)) != 0
        got = {net.free_port() for _ in range(10)}
        assert taken not in got
        if free_below:
            assert got == {taken - 1}


def test_unreadable_range_falls_back_to_the_default(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(net.RANGE_ENV, raising=False)
    monkeypatch.setattr(net, "PORT_RANGE_FILE", tmp_path / "missing")
    assert net.ephemeral_low() == 32768
    monkeypatch.setattr(net, "LOWEST_PORT", 40000)  # no room below: the kernel's pick
    port = net.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_the_range_variable_narrows_the_picks_and_names_itself(monkeypatch) -> None:
    low = net.ephemeral_low()
    monkeypatch.setenv(net.RANGE_ENV, f"{low - 40}-{low - 31}")
    monkeypatch.setattr(net, "_handed", set())
    got = [net.free_port() for _ in range(5)]
    assert all(low - 40 <= p <= low - 31 for p in got)
    # no port twice while the range has others: two picks before either server binds differ
    assert len(set(got)) == 5
    for bad in ("20000", "x-y", "30000-20000", "80-90"):
        monkeypatch.setenv(net.RANGE_ENV, bad)
        with pytest.raises(ValueError, match=net.RANGE_ENV):
            net.free_port()
