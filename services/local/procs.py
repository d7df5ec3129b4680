"""Child-process supervision for `r3flow local`: start, log to files, stop by pid.

Every child runs in its own session (process group) so that stopping it also stops what it
spawned (vLLM's EngineCore, Ray workers); children are only ever signalled by their own pid/pgid.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.rollout.vllm_compat import CUTS_PREFIX

log = logging.getLogger(__name__)


class ChildDied(RuntimeError):
    """A child of the run exited when it should not have."""

    def __init__(self, name: str, returncode: int, log_path: Path, lines: int = 20) -> None:
        self.name = name
        self.returncode = returncode
        self.log_tail = tail(log_path, lines)
        self.cause = last_critical(log_path)
        cause = f"; cause: {self.cause}" if self.cause else ""
        super().__init__(f"{name} exited with {returncode}{cause}; last log lines:\n"
                         f"{self.log_tail}")


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    # A service that runs until it is stopped (the store): any exit of its own is a death.
    # Others (a rollout worker at the end of its prompts) may exit 0 on their own.
    persistent: bool = False

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} not started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Supervisor:
    """Owns the children of one local run; `stop_all` ends each by pid (process group)."""

    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, args: list[str], persistent: bool = False) -> Child:
        argv = [sys.executable, "-m", "services.cli", *args]
        child = Child(name, argv, self.log_dir / f"{name}.log", persistent=persistent)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._spawn(child)
        self.children.append(child)
        log.info("started %s (pid %d): %s", name, child.pid, " ".join(args))
        return child

    def _spawn(self, child: Child) -> None:
        out = child.log_path.open("ab")
        env = {**os.environ, **self.env}
        child.proc = subprocess.Popen(child.argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()

    def restart(self, child: Child) -> Child:
        """Start a child again with the same command and config (after a crash or a kill);
        what is left of its old process group is killed first."""
        if child.alive():
            raise RuntimeError(f"{child.name} (pid {child.pid}) is still running")
        _signal_group(child.pid, signal.SIGKILL)
        self._spawn(child)
        log.info("restarted %s (pid %d)", child.name, child.pid)
        return child

    def kill(self, child: Child, sig: int = signal.SIGKILL) -> None:
        """Signal a child's whole process group (fault injection: SIGKILL, SIGSTOP, SIGCONT)."""
        _signal_group(child.pid, sig)
        if sig == signal.SIGKILL:
            child.proc.wait(timeout=10)  # type: ignore[union-attr]

    def check(self) -> None:
        """ChildDied (name, exit code, the tail of its log) if a child exited unexpectedly:
        with a non-zero code, or at all for a persistent one."""
        for c in self.children:
            rc = None if c.proc is None else c.proc.poll()
            if rc is not None and (rc != 0 or c.persistent):
                raise ChildDied(c.name, rc, c.log_path)

    def stop(self, child: Child, timeout_s: float = 15.0) -> tuple[float, bool]:
        """SIGTERM to the child itself, as Kubernetes does to a container's main process (it
        stops its own engine/Ray helpers); after `timeout_s`, or once it exited, SIGKILL to
        whatever is left of its process group. Returns (seconds it took to exit after
        SIGTERM, whether it had to be killed)."""
        t0, killed = time.monotonic(), False
        if child.alive():
            os.kill(child.pid, signal.SIGTERM)
            try:
                child.proc.wait(timeout=timeout_s)  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM for %.0fs; killing it", child.name, timeout_s)
                killed = True
        seconds = time.monotonic() - t0
        if child.proc is not None:
            _signal_group(child.pid, signal.SIGKILL)
            child.proc.wait(timeout=5)
        return seconds, killed

    def stop_all(self) -> None:
        for child in reversed(self.children):
            self.stop(child)


def _signal_group(pid: int, sig: int) -> None:
    if sig == signal.SIGKILL:
        kill_group(pid)
        return
    try:
        os.killpg(pid, sig)  # the child is its own session leader: pgid == pid
    except ProcessLookupError:
        pass


SHM_DIR = "/dev/shm"


def group_shm(pgid: int) -> set[str]:
    """Files under /dev/shm that the live processes of process group `pgid` map (vLLM's
    message-queue ring buffers, 160-240 MiB each on CPU): killed, their creator never unlinks
    them, and nor does its resource tracker (a member of the same group); and the routing
    cut-file directories its rollout frontends made (named by their pid)."""
    import psutil

    names: set[str] = set()
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) != pgid:
                continue
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
        except (ProcessLookupError, FileNotFoundError, PermissionError, psutil.Error):
            continue
        # the rollout frontend's routing cut files (services/rollout/vllm_compat.py CutFiles)
        names.update(str(d) for d in Path(SHM_DIR).glob(f"{CUTS_PREFIX}{proc.pid}-*"))
        for line in maps.splitlines():  # address perms offset dev inode [path]
            fields = line.split(maxsplit=5)
            path = fields[5] if len(fields) == 6 else ""
            if os.path.dirname(path) == SHM_DIR and not path.endswith(" (deleted)"):
                names.add(path)  # a file directly in /dev/shm, still linked
    return names


def kill_group(pgid: int) -> None:
    """SIGKILL the process group, then unlink the shared-memory files its processes mapped
    (tmpfs: host RAM that would stay taken until reboot)."""
    shm = group_shm(pgid)
    try:
        os.killpg(pgid, signal.SIGKILL)  # the child is its own session leader: pgid == pid
    except ProcessLookupError:
        pass
    for path in shm:
        try:
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            log.info("removed %s, left in shared memory by process group %d", path, pgid)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove %s (process group %d): %s", path, pgid, e)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def last_critical(path: Path, lines: int = 400) -> str | None:
    """The last CRITICAL log line near the end of a child's log (its one-line cause of death),
    without the timestamp."""
    for line in reversed(tail(path, lines).splitlines()):
        if " CRITICAL " in line:
            return line.split(" CRITICAL ", 1)[1].strip()
    return None


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2,
             supervisor: Supervisor | None = None) -> None:
    """Poll `predicate` until true; TimeoutError naming `what`; re-raise child deaths early."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if supervisor is not None:
            supervisor.check()
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
