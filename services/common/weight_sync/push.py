"""One push of a sender (`PushOwner`; weight_sync.sender's `WeightSender`): join or reuse the group, stream checksummed
buckets with a bounded number in flight, collect every member's "verified" ack, then commit or
abort. Failures are attributed to members by the `MemberMonitor`."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, ItemsView, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from services.common.pb.r3flow.v1 import store_pb2
from services.common.weight_sync import buckets as bk
from services.common.weight_sync import headers as hd
from services.common.weight_sync import sums as hs
from services.common.weight_sync.group import (
    CachedGroup,
    Keys,
    WaitTimeout,
    WeightSyncError,
    broadcast,
    discard,
    group_signature,
    make_process_group,
    members_of,
    poll_until,
    push_store,
    wait_keys,
    wait_work,
    waits_on_host,
)
from services.common.weight_sync.layout import (
    BucketLayout,
    LaidBucket,
    PackedLayout,
    StreamLayout,
    publish,
    refit,
)
from services.common.weight_sync.monitor import MemberMonitor

if TYPE_CHECKING:
    from services.common.weight_sync.config import WeightSyncConfig

log = logging.getLogger(__name__)


class PushOwner(Protocol):
    """What a push reads and updates on its sender (weight_sync.sender's `WeightSender`): the
    rendezvous root store, the cached group and the last layout, kept across pushes."""

    cfg: WeightSyncConfig
    addr: str
    device: torch.device
    bucket_bytes: int
    direct_min_bytes: int
    wire: torch.dtype
    _root: dist.TCPStore
    _pool: list[torch.Tensor | None]
    _group: CachedGroup | None
    _reuse: int | None
    _layout: BucketLayout | None
    _layout_digest: str
    _streamed: StreamLayout
    _packed: PackedLayout
    _side: torch.cuda.Stream | None


class TransportError(RuntimeError):
    """Internal: the backend failed a collective (the monitor finds out whose fault it is)."""


@dataclass(frozen=True)
class PushReport:
    """What one successful push moved."""

    version: int
    members: tuple[str, ...]
    num_tensors: int
    num_buckets: int
    num_bytes: int
    seconds: float
    new_group: bool
    """False when the previous push's group was reused (same members)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds from `push()` to: joined, end_header (every checksum published), drained
    (every broadcast done on the sender), acked, committed."""
    host_s: dict[str, float] = field(default_factory=dict)
    """Host seconds spent drawing the input (produce) and packing and posting the buckets,
    retiring the oldest ones included (send)."""

    @property
    def gb_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class Push:
    """State of one push: its store prefix, group, monitor and buckets in flight."""

    def __init__(self, sender: PushOwner, plan: store_pb2.WeightSyncPlan) -> None:
        self.s, self.cfg, self.version, self.plan = sender, sender.cfg, plan.version, plan
        self.store = push_store(sender._root, plan.version)
        self.members = members_of(plan)
        self.monitor = MemberMonitor(self.store, self.members, self.version,
                                     self.cfg.heartbeat_timeout_s)
        self.pg: dist.ProcessGroup | None = None
        self.new_group = True
        self.host_blocking = waits_on_host(plan.backend)  # the plan's: CUDA IPC or the config's
        self.layout_sent = self.streamed = self.packed = False
        self.published = 0  # the header key receivers may wait on next (written or not)
        self.t0 = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.host_s: dict[str, float] = {}
        self.last_work: dist.Work | None = None
        # (broadcast, pool slot, bucket, event after its checksum on the side stream)
        self.inflight: deque[tuple[dist.Work, int | None, torch.Tensor,
                                   torch.cuda.Event | None]] = deque()

    def run(self, named) -> PushReport:
        t0 = self.t0 = time.perf_counter()
        try:
            buckets = self._announce(named)  # laid out while the members join
            self._join()
            self._mark("joined")
            tensors, nbuckets, nbytes = self._stream(buckets)
            self._collect_acks()
            self._mark("acked")
        except WeightSyncError as e:
            self._abort(str(e))
            raise
        except (TransportError, WaitTimeout) as e:
            err = self.monitor.diagnose(f"{type(e).__name__}: {e}")
            self._abort(str(err))
            raise err from e
        except BaseException as e:  # e.g. the caller's tensor generator failed
            self._abort(f"sender failed: {type(e).__name__}: {e}")
            raise
        self.store.set(Keys.COMMIT, "1")
        self._mark("committed")
        assert self.pg is not None
        self.s._group = CachedGroup(group_signature(self.plan), self.version, self.pg)
        report = PushReport(self.version, tuple(str(m) for m in self.members), tensors,
                            nbuckets, nbytes, time.perf_counter() - t0, self.new_group,
                            self.phases, self.host_s)
        log.info("weight push v%d: %d tensors, %.1f MB in %.2f s (%.2f GB/s) to %d ranks",
                 self.version, tensors, nbytes / 1e6, report.seconds, report.gb_s,
                 len(self.members))
        return report

    def _deadline(self) -> float:
        return time.monotonic() + self.cfg.timeout_s

    def _mark(self, phase: str) -> None:
        self.phases[phase] = time.perf_counter() - self.t0

    def _join(self) -> None:
        """Wait until every member is connected and heart-beating, then form the group."""
        keys = [Keys.join(m.rank) for m in self.members]
        try:
            wait_keys(self.store, keys, self._no_errors, self._deadline(), "joins")
        except WaitTimeout:
            names = tuple(str(m) for m in self.members if not self.store.check([Keys.join(m.rank)]))
            raise WeightSyncError(f"weight push v{self.version}: member(s) {', '.join(names)} "
                                  f"did not join within {self.cfg.timeout_s} s",
                                  version=self.version, members=names) from None
        self._form_group()

    def _form_group(self) -> None:
        """Reuse the last group if every member still holds it, else build a new one."""
        reuse, cached = self.s._reuse, self.s._group
        joins = self.store.multi_get([Keys.join(m.rank) for m in self.members])
        if reuse is not None and cached is not None and cached.version == reuse and all(
                j == f"reuse:{reuse}".encode() for j in joins):
            self.store.set(Keys.GO, "reuse")
            self.pg, self.new_group = cached.pg, False
            return
        self.s._group = None  # idle (no op in flight): dropped at once
        self.store.set(Keys.GO, "new")
        with self._transport_errors():
            self.pg = make_process_group(self.store, 0, len(self.members) + 1,
                                         self.plan.backend, self.cfg.timeout_s,
                                         self.s.addr)

    def _no_errors(self) -> None:
        if self.monitor.reported():
            raise self.monitor.diagnose("a member failed while joining")

    def _stream(self, buckets: Iterable[tuple[LaidBucket, list[torch.Tensor]]]
                ) -> tuple[int, int, int]:
        """Pack and broadcast each bucket, `inflight_buckets` at a time. The end header (every
        checksum) goes out while the last buckets are still on the wire, so receivers verify
        the last bucket the moment it lands."""
        sums: list[torch.Tensor] = []
        tensors = nbytes = 0
        produce = send = 0.0  # host seconds: drawing the input; packing + posting
        t = time.perf_counter()
        for laid, sources in buckets:
            t1 = time.perf_counter()
            sums.append(self._send(laid, sources))
            tensors, nbytes = tensors + len(laid.entries), nbytes + laid.nbytes
            t2 = time.perf_counter()
            produce, send, t = produce + t1 - t, send + t2 - t1, t2
        self.host_s = {"produce": produce, "send": send}
        end = hd.encode_end(len(sums), tensors, nbytes, self._host_sums(sums))
        self.store.set(Keys.header(len(sums)), end)
        self.published = len(sums) + 1  # an abort now wakes receivers through `commit`
        self._mark("end_header")
        self._drain()
        self._mark("drained")
        return tensors, len(sums), nbytes

    def _announce(self, named) -> Iterable[tuple[LaidBucket, list[torch.Tensor]]]:
        """Write `layout` (receivers read it after `go`): every bucket's header (a sized
        input: receivers post every bucket at once), or `stream` (a generator: a header before
        each bucket)."""
        s, listed = self.s, self._listed(named)
        self.streamed = listed is None
        if listed is not None:
            assert s._layout is not None
            s._layout_digest = publish(s._root, s._layout, s._layout_digest)
            self.store.set(Keys.LAYOUT, Keys.LAYOUT_REF + s._layout_digest)
            self.published = len(listed)  # the end header's key
        else:
            self.store.set(Keys.LAYOUT, Keys.STREAM)
        self.layout_sent = True
        if listed is not None:
            return listed
        items = iter(named)
        head = next(items, None)
        rest = itertools.chain([] if head is None else [head], items)
        if isinstance(head, bk.PackedBucket):  # whole buckets, packed by the producer
            self.packed = True
            return s._packed.stream(rest, s.device)
        return s._streamed.stream(rest, s.bucket_bytes, s.wire, s.device, s.direct_min_bytes)

    def _send(self, laid: LaidBucket, sources: list[torch.Tensor]) -> torch.Tensor:
        """Pack, broadcast and sum one bucket (summed while it is on the wire: both only
        read the buffer; on the CPU a packed bucket is summed by its pack); returns its
        checksums (on the device)."""
        slot = self._free_slot(laid)
        bucket, summed = self._pack(laid, sources, slot)
        if self.streamed:
            self.store.set(Keys.header(laid.index), laid.header)
            self.published = laid.index + 1
        assert self.pg is not None
        work = broadcast(self.pg, bucket)
        event = None
        if summed is None:
            summed, event = bk.summed_on(self.s._side, bucket, laid.entries, laid.bounds)
        self.inflight.append((work, slot, bucket, event))
        return summed

    def _host_sums(self, sums: list[torch.Tensor]) -> list[list[int]]:
        def wait(done: Callable[[], bool]) -> None:
            with self._transport_errors():
                poll_until(done, self.monitor.check, self._deadline(), "the checksums",
                           max_sleep_s=1e-3)

        return hs.host_sums(sums, self.s._side, wait)

    def _listed(self, named) -> list[tuple[LaidBucket, list[torch.Tensor]]] | None:
        """Every bucket of a list / dict / dict.items(), reusing the last push's layout as
        far as it fits; None for a generator (streamed: packed as the tensors come)."""
        s = self.s
        if isinstance(named, Mapping):
            named = list(named.items())
        elif isinstance(named, ItemsView):  # dict.items(): sized and re-iterable, not streamed
            named = list(named)
        if not isinstance(named, Sequence):
            return None
        s._layout = refit(s._layout, named, s.bucket_bytes, s.wire, s.device,
                          s.direct_min_bytes)
        return [(laid, laid.sources(named)) for laid in s._layout]

    def _pack(self, laid: LaidBucket, sources: list[torch.Tensor], slot: int | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The bucket to broadcast: the tensor itself (direct) or packed into a buffer; and
        its checksums where the pack computed them (CPU), else None."""
        if laid.direct:
            return sources[0].detach().reshape(-1).view(torch.uint8), None
        oversized = laid.nbytes > self.s.bucket_bytes  # one tensor: a one-off buffer
        if oversized:
            bucket = torch.empty(laid.nbytes, dtype=torch.uint8, device=self.s.device)
        else:
            assert slot is not None
            bucket = self._pool_buffer(slot)[: laid.nbytes]
        summed = bk.pack_and_sum(bucket, laid.entries, sources, laid.bounds)
        if summed is not None:
            return bucket, summed
        if oversized:
            views = bk.bucket_views(bucket, laid.entries)
        else:
            assert slot is not None
            views = laid.views.get(slot) or laid.views.setdefault(
                slot, bk.bucket_views(bucket, laid.entries))
        with torch.no_grad():  # one multi-tensor launch on GPU, not one copy per tensor
            torch._foreach_copy_(views, sources)
        return bucket, None

    def _free_slot(self, laid: LaidBucket) -> int | None:
        """A pool slot to pack `laid` into, retiring the oldest broadcasts until one is free.
        A bucket sent in place needs none: a tensor of the caller's is posted at once, so the
        packs behind it do not wait for it; a packed bucket (the producer's own buffer) waits
        for a place among `inflight_buckets`, which bounds the buffers a push holds."""
        if laid.direct:
            while self.packed and len(self.inflight) >= self.cfg.inflight_buckets:
                self._retire_oldest()
            return None
        while True:
            busy = {entry[1] for entry in self.inflight}
            free = [i for i in range(self.cfg.inflight_buckets) if i not in busy]
            if free:
                return free[0]
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        """Free the oldest bucket's buffer: gloo waits on the host (polled, so a dead member
        cannot hang us); NCCL only orders the current stream after it (the host runs on)."""
        work, _, _, event = self.inflight[0]
        with self._transport_errors():
            if self.host_blocking:
                wait_work(work, self.monitor.check, self._deadline(), self.host_blocking)
            else:
                work.wait()
            if event is not None:  # the slot's checksum (side stream) read it too
                torch.cuda.current_stream(self.s.device).wait_event(event)
        self.last_work = work
        self.inflight.popleft()

    def _drain(self) -> None:
        """Wait until every broadcast completed (NCCL runs them in order: the last one)."""
        while self.inflight:
            self._retire_oldest()
        if not self.host_blocking and self.last_work is not None:
            with self._transport_errors():
                wait_work(self.last_work, self.monitor.check, self._deadline(),
                          self.host_blocking)
        if self.s._side is not None:  # the next push packs into buffers the sums read
            torch.cuda.current_stream(self.s.device).wait_stream(self.s._side)

    @contextlib.contextmanager
    def _transport_errors(self) -> Iterator[None]:
        try:
            yield
        except WeightSyncError:
            raise
        except RuntimeError as e:
            raise TransportError(str(e)) from e

    def _pool_buffer(self, slot: int) -> torch.Tensor:
        buf = self.s._pool[slot]
        if buf is None:
            buf = torch.empty(self.s.bucket_bytes, dtype=torch.uint8, device=self.s.device)
            self.s._pool[slot] = buf
        return buf

    def _collect_acks(self) -> None:
        """Every member verified every bucket, or the push fails naming who did not."""
        keys = [Keys.ack(m.rank) for m in self.members]
        try:
            wait_keys(self.store, keys, self.monitor.check, self._deadline(), "acks")
        except WaitTimeout:
            missing = [m for m in self.members if not self.store.check([Keys.ack(m.rank)])]
            raise self.monitor.blame(missing, "no ack within timeout_s") from None
        acks = self.store.multi_get(keys)
        bad = [(m, a.decode()) for m, a in zip(self.members, acks, strict=True) if a != b"ok"]
        if bad:
            raise self.monitor.blame([m for m, _ in bad], "; ".join(why for _, why in bad))

    def _abort(self, reason: str) -> None:
        log.error("weight push v%d aborted: %s", self.version, reason)
        try:
            self.store.set(Keys.ABORT, reason)
            keys = [Keys.GO, Keys.header(self.published), Keys.COMMIT]
            for key in keys + ([] if self.layout_sent else [Keys.LAYOUT]):
                self.store.set(key, Keys.ABORTED)  # wakes receivers blocked on these keys
        except RuntimeError:
            log.exception("could not write the abort keys")
        pending: list[object] = list(self.inflight)
        self.inflight.clear()
        self.s._group = None
        discard(self.pg, pending, linger_s=self.cfg.timeout_s + 10)
        self.pg = None
