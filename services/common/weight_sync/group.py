"""The weight-sync group: membership from a `WeightSyncPlan`, the store keys of one push, a
process group built without `init_process_group`, and waits that watch the members.

The trainer's sender (rank 0) hosts a `TCPStore`; each push lives under the prefix
`ws/v{version}/` and builds its own `ProcessGroupGloo` / `ProcessGroupNCCL` on a
`PrefixStore`, so it never touches the trainer's default (megatron) group and members may
change between pushes. Keys under a push prefix:

  params        sender's timing settings (JSON), read by receivers at join
  join/{r}      rank r is connected and heart-beating; go: every member joined
  hb/{r}        "{beats}:{buckets verified}", refreshed by rank r's heartbeat thread
  layout        "ref:{digest}" when the sender knows every bucket up front (a list or dict of
                tensors): the layout (JSON list of bucket headers) is the root key
                layouts/{digest}, written once per distinct layout (steady-state pushes repeat
                it: a few bytes on the critical path instead of the whole layout); else "stream"
  header/{k}    layout of bucket k, streamed pushes only; header/{number of buckets}: the
                end header (totals and every tensor's checksum)
  ack/{r}       "ok" or "fail: ..." once rank r has verified every bucket
  errors, err/{r}  count of members that failed, and each one's reason
  commit | abort   the sender's decision; receivers load only after commit (an aborting
                   sender also writes Keys.ABORTED into go, the next header and commit)
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from services.common.pb.r3flow.v1 import store_pb2

BACKENDS = ("gloo", "nccl", "ipc")


class WeightSyncError(RuntimeError):
    """A push failed; `members` names the group members held responsible (may be empty)."""

    def __init__(self, message: str, *, version: int, members: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.version = version
        self.members = members


class WeightSyncAborted(WeightSyncError):
    """The sender aborted the push (or vanished): the receiver discards what it staged."""


def nccl_version() -> str:
    """This process's NCCL version ('2.21.5'), '' where torch has no NCCL (CPU builds)."""
    try:
        return ".".join(str(v) for v in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        return ""


def nccl_mismatch(backend: str, sender: str, mine: str, version: int, who: str) -> str | None:
    """Why this receiver must refuse the push (NCCL refuses peers of another NCCL version,
    in a way that hangs or fails deep inside the first collective), or None."""
    if backend != "nccl" or sender == mine:
        return None
    return (f"weight sync v{version}: NCCL version mismatch: the sender (trainer) runs NCCL "
            f"{sender or 'unknown'}, {who} runs NCCL {mine or 'none (a CPU torch build)'}; "
            "trainer and rollout images must share one torch/NCCL build")


class WaitTimeout(Exception):
    """Internal: a wait ran past its deadline (the caller names the members)."""


@dataclass(frozen=True)
class Member:
    """One receiving rank of the group (a rollout worker brings `world_size` of them)."""

    rank: int
    worker_id: str
    local_rank: int
    world_size: int

    def __str__(self) -> str:
        local = f"[{self.local_rank}]" if self.world_size > 1 else ""
        return f"{self.worker_id}{local} (rank {self.rank})"


def group_signature(plan: store_pb2.WeightSyncPlan) -> tuple:
    """What must not change for a group to be reused: the members, in order, and the backend."""
    return (plan.backend, tuple((m.worker_id, max(1, m.world_size)) for m in plan.members))


@dataclass(frozen=True)
class CachedGroup:
    """The sender's group of its last good push, reused while the signature holds."""

    signature: tuple
    version: int
    pg: dist.ProcessGroup


def members_of(plan: store_pb2.WeightSyncPlan) -> list[Member]:
    """Receiving ranks in plan order: rank 0 is the sender, workers follow."""
    out: list[Member] = []
    for info in plan.members:
        size = max(1, info.world_size)
        base = 1 + len(out)
        out += [Member(base + i, info.worker_id, i, size) for i in range(size)]
    return out


def rank_in(plan: store_pb2.WeightSyncPlan, worker_id: str, local_rank: int = 0) -> Member:
    """The member that (worker_id, local_rank) plays in `plan`; ValueError if absent."""
    for m in members_of(plan):
        if m.worker_id == worker_id and m.local_rank == local_rank:
            return m
    raise ValueError(f"worker_id: {worker_id!r} (local rank {local_rank}) is not a member "
                     f"of weight-sync plan v{plan.version}")


class Keys:
    """Store keys of one push (relative to its prefix)."""

    PARAMS, GO, COMMIT, ABORT, ERRORS = "params", "go", "commit", "abort", "errors"
    LAYOUT, STREAM, LAYOUT_REF = "layout", "stream", "ref:"
    # Written by an aborting sender into every key a receiver may be blocked on (go, layout,
    # the next header, commit): receivers block in `get` instead of polling, and still wake at once.
    ABORTED = "\x00aborted"

    @staticmethod
    def prefix(version: int) -> str:
        return f"ws/v{version}/"

    @staticmethod
    def join(rank: int) -> str:
        return f"join/{rank}"

    @staticmethod
    def hb(rank: int) -> str:
        return f"hb/{rank}"

    @staticmethod
    def ack(rank: int) -> str:
        return f"ack/{rank}"

    @staticmethod
    def err(rank: int) -> str:
        return f"err/{rank}"

    @staticmethod
    def header(index: int) -> str:
        return f"header/{index}"

    @staticmethod
    def layout_blob(digest: str) -> str:
        """Root-store key (outside any push prefix) of the layout with this digest."""
        return f"layouts/{digest}"


def connect_store(addr: str, port: int, timeout_s: float, *, server: bool) -> dist.TCPStore:
    """The sender hosts the store (port 0 picks a free port); receivers connect to it."""
    return dist.TCPStore(addr, port, None, server, timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def push_store(root: dist.Store, version: int) -> dist.PrefixStore:
    return dist.PrefixStore(Keys.prefix(version), root)


def make_process_group(store: dist.Store, rank: int, size: int, backend: str,
                       timeout_s: float, host: str = "") -> Any:
    """A standalone gloo/NCCL group on `store`: no default group is created or used.

    `host` is the address gloo binds to ("" = gloo's default: this host's name, or
    GLOO_SOCKET_IFNAME)."""
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in the stubs
        opts._timeout = timedelta(seconds=timeout_s)
        gloo = dist.ProcessGroupGloo
        opts._devices = [gloo.create_device(hostname=host) if host
                         else gloo.create_default_device()]
        return dist.ProcessGroupGloo(store, rank, size, opts)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        # Our own waits detect a dead member and abort() the group well before this fires;
        # NCCL's watchdog would otherwise tear the whole trainer process down.
        opts._timeout = timedelta(seconds=timeout_s * 4 + 60)
        return ProcessGroupNCCL(store, rank, size, opts)
    if backend == "ipc":  # members on the sender's GPU (weight_sync.ipc)
        from services.common.weight_sync.ipc import IpcGroup

        return IpcGroup(store, rank, size)
    raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")


def waits_on_host(backend: str) -> bool:
    """gloo and IPC ops complete on the host (waited for in slices); NCCL ops are
    stream-ordered: the host only polls them where it must (the last bucket, the acks)."""
    return backend in ("gloo", "ipc")


def broadcast(pg: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    """Async broadcast from rank 0 (the sender) into `tensor` on every rank."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return pg.broadcast([tensor], opts)


def discard(pg: dist.ProcessGroup | None, works: list, linger_s: float) -> None:
    """Abort a failed group without blocking the caller.

    The destructors of a gloo group and of its pending works block until in-flight ops time
    out, so a daemon thread keeps them (and `works`, which is emptied) alive for `linger_s`,
    past the group's op timeout: whoever else drops a reference (an exception's traceback
    frames, say) is then never the last one.
    """
    if pg is not None:
        try:
            pg.abort()
        except RuntimeError:
            pass  # abort is best effort; the group is dropped either way
    holder: list = [pg, *works]
    works.clear()
    del pg

    def linger() -> None:
        time.sleep(linger_s)
        holder.clear()

    threading.Thread(target=linger, name="weight-sync-discard", daemon=True).start()


def poll_until(ready: Callable[[], bool], check: Callable[[], None], deadline: float,
               what: str = "", *, max_sleep_s: float = 5e-3) -> None:
    """Poll until `ready()`; run `check()` every 50 ms; WaitTimeout at the deadline.

    Sleeps grow with the time already waited (1/32 of it, `max_sleep_s` at most), so a wait
    overshoots by about 3% at most (it sits on a push's critical path: the last bucket's
    completion, the acks) and a long one costs at most 1/max_sleep_s polls a second."""
    start = next_check = time.monotonic()
    while not ready():
        now = time.monotonic()
        if now >= next_check:
            check()
            next_check = now + 0.05
        if now >= deadline:
            raise WaitTimeout(f"timed out waiting for {what or 'the group'}")
        time.sleep(min(max_sleep_s, max(2e-5, (now - start) / 32)))


def wait_keys(store: dist.Store, keys: list[str], check: Callable[[], None], deadline: float,
              what: str = "") -> None:
    """Poll until every key is set (`check()` runs between polls); WaitTimeout at the deadline.

    Polled rather than `store.wait(keys, short_timeout)` in slices: every expired slice makes
    c10d log two warnings."""
    poll_until(lambda: store.check(keys), check, deadline, what or ", ".join(keys))


def wait_work(work: dist.Work, check: Callable[[], None], deadline: float,
              gloo: bool) -> None:
    """Wait for a collective without blocking for long in C++ (so a dead peer cannot hang
    us): gloo blocks in slices of 50 ms (it wakes the moment the op ends), NCCL is polled
    (cheaply: a query of the op's CUDA event, so at most every millisecond)."""
    if not gloo:
        poll_until(work.is_completed, check, deadline, "a broadcast", max_sleep_s=1e-3)
        work.wait()  # NCCL: orders the current stream after the op
        return
    while True:
        try:
            work.wait(timedelta(milliseconds=50))
            return
        except RuntimeError:
            if work.is_completed():
                # it ended just after the slice ran out (then this returns), or it failed
                # (a peer died, gloo's own timeout: then this raises that error)
                work.wait()
                return
        check()
        if time.monotonic() >= deadline:
            raise WaitTimeout("timed out waiting for a broadcast") from None


class Heartbeat:
    """Receiver side: refreshes `hb/{rank}` on its own store connection every `interval_s`."""

    def __init__(self, store: dist.Store, rank: int, interval_s: float) -> None:
        self.store, self.key, self.interval_s = store, Keys.hb(rank), interval_s
        self.progress = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-sync-hb", daemon=True)

    def start(self) -> Heartbeat:
        self._beat(0)
        self._thread.start()
        return self

    def _beat(self, n: int) -> None:
        self.store.set(self.key, f"{n}:{self.progress}")

    def _run(self) -> None:
        n = 1
        while not self._stop.wait(self.interval_s):
            try:
                self._beat(n)
            except RuntimeError:
                return  # the sender's store is gone: the main thread finds out by itself
            n += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def local_addr_toward(addr: str) -> str:
    """This host's address on the route to `addr` (nothing is sent), for gloo to bind: the
    address the sender and the other members reach this pod on, whatever its hostname resolves
    to ("" = gloo's default when there is no route)."""
    if _is_loopback(addr):
        return addr
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
    except OSError:
        return ""
