"""Rollout side: `WeightReceiver` joins the group of one plan, stages every bucket, verifies
each tensor's checksum, acks, and hands the tensors to the caller only after the sender's
commit. On abort (or any failure) the staged buffers are dropped and nothing is returned, so
an engine never serves a mix of old and new weights."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from services.common.pb.r3flow.v1 import store_pb2
from services.common.weight_sync import buckets as bk
from services.common.weight_sync import headers as hd
from services.common.weight_sync import sums as hs
from services.common.weight_sync.group import (
    Heartbeat,
    Keys,
    Member,
    WaitTimeout,
    WeightSyncAborted,
    WeightSyncError,
    broadcast,
    connect_store,
    discard,
    local_addr_toward,
    make_process_group,
    members_of,
    nccl_mismatch,
    nccl_version,
    push_store,
    rank_in,
    wait_work,
    waits_on_host,
)

log = logging.getLogger(__name__)
# A bucket's (nbytes, entries, checksum bounds on the device or None)
_Layout = tuple[int, list[bk.TensorEntry], bk.ChecksumPlan]


class ReceivedWeights:
    """A committed push. `named` are views into the receiver's staging buffers, built on
    first use: load them before the next `receive()` (which may reuse the buffers)."""

    def __init__(self, version: int, buckets: list[tuple[torch.Tensor, list[bk.TensorEntry]]],
                 num_bytes: int, seconds: float) -> None:
        self.version, self.num_bytes, self.seconds = version, num_bytes, seconds
        self._buckets = buckets
        self._named: list[tuple[str, torch.Tensor]] | None = None

    @property
    def named(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor in the wire dtype) in the sender's order."""
        if self._named is None:
            self._named = [(e.name, view) for bucket, entries in self._buckets
                           for e, view in zip(entries, bk.bucket_views(bucket, entries),
                                              strict=True)]
        return self._named

    def __len__(self) -> int:
        return sum(len(entries) for _, entries in self._buckets)

    def as_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.named)


@dataclass
class _Staged:
    """One bucket being received: its header, buffer and broadcast handle."""

    index: int
    entries: list[bk.TensorEntry]
    bucket: torch.Tensor
    work: dist.Work
    bounds: bk.ChecksumPlan


class WeightReceiver:
    """One engine rank's end of the weight-sync group (kept for the engine's lifetime)."""

    def __init__(self, worker_id: str, local_rank: int = 0, device: str | torch.device = "cpu",
                 *, reuse_buffers: bool = True, connect_timeout_s: float = 60.0) -> None:
        self.worker_id, self.local_rank = worker_id, local_rank
        self.device = torch.device(device)
        self.reuse_buffers = reuse_buffers
        self.connect_timeout_s = connect_timeout_s
        self._staging: list[torch.Tensor] = []
        self.ring_buffers: list[torch.Tensor] = []  # streamed pushes (receiver_stream)
        self._layouts: dict[int, tuple[bytes, _Layout]] = {}  # streamed pushes, per bucket
        self._listed: tuple[bytes, list[_Layout]] | None = None  # the last `layout` key
        self._root: dist.TCPStore | None = None
        self._root_addr: tuple[str, int] | None = None
        # (version, group) of the last committed push, reused when the sender asks for it
        self._group: tuple[int, dist.ProcessGroup] | None = None

    def receive(self, plan: store_pb2.WeightSyncPlan,
                on_bucket: Callable[[int], None] | None = None) -> ReceivedWeights:
        """Take part in the push of `plan`; returns the weights once the sender committed.

        Raises WeightSyncAborted when the push was aborted (nothing to load) and
        WeightSyncError when this receiver failed. `on_bucket(k)` runs after bucket k arrived
        (gloo) or was queued (NCCL).
        """
        member = rank_in(plan, self.worker_id, self.local_rank)
        return _Receive(self, plan, member, on_bucket).run()

    def root_store(self, addr: str, port: int) -> dist.TCPStore:
        """The connection to the sender's store, reused while the sender stays the same and
        the connection answers (a sender restarted at the same address leaves it broken)."""
        if self._root is not None and self._root_addr == (addr, port):
            try:
                self._root.check([Keys.PARAMS])
            except RuntimeError:  # DistNetworkError: the old sender is gone
                self.drop_root()
        if self._root is None or self._root_addr != (addr, port):
            self._root = connect_store(addr, port, self.connect_timeout_s, server=False)
            self._root_addr = (addr, port)
            self._group = None  # a new sender never reuses an old group
        return self._root

    def drop_root(self) -> None:
        """Forget the sender's store connection: the next push connects afresh (a restarted
        sender may listen at the same address, and a broken connection never heals)."""
        self._root, self._root_addr, self._group = None, None, None

    def layout(self, index: int, header: bytes) -> _Layout | None:
        """(nbytes, entries, checksum bounds) of a bucket header, None for the end header;
        decoded once while the sender's layout repeats (the Python work per tensor is what
        limits a push at NCCL speed)."""
        cached = self._layouts.get(index)
        if cached is not None and cached[0] == header:
            return cached[1]
        head = hd.decode_header(header)
        if head.get("end"):
            return None
        self._layouts[index] = (header, self._parse(head))
        return self._layouts[index][1]

    def push_layout(self, raw: bytes, fetch: Callable[[str], bytes]) -> list[_Layout] | None:
        """Every bucket's (nbytes, entries, checksum bounds) from a push's `layout` key, None
        for a streamed push (per-bucket headers). The key names the layout by digest; it is
        fetched (`fetch(root key)`) and decoded only when the digest changes."""
        if raw == Keys.STREAM.encode():
            return None
        ref = raw.decode()
        if not ref.startswith(Keys.LAYOUT_REF):
            raise RuntimeError(f"layout: unexpected value {ref[:40]!r} (sender too old?)")
        if self._listed is None or self._listed[0] != raw:
            blob = fetch(Keys.layout_blob(ref.removeprefix(Keys.LAYOUT_REF)))
            self._listed = (raw, [self._parse(hd.parse_header(h)) for h in json.loads(blob)])
        return self._listed[1]

    def _parse(self, head: dict) -> _Layout:
        entries = head["tensors"]
        return head["nbytes"], entries, bk.checksum_plan(entries, head["nbytes"], self.device)

    def staging(self, index: int, nbytes: int) -> torch.Tensor:
        """Bucket `index`'s staging buffer (reused across pushes when big enough)."""
        while len(self._staging) <= index:
            self._staging.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._staging[index].numel() < nbytes or not self.reuse_buffers:
            self._staging[index] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._staging[index][:nbytes]


class _Receive:
    """State of one receive: store prefix, heartbeat, group, staged buckets."""

    def __init__(self, rx: WeightReceiver, plan: store_pb2.WeightSyncPlan, member: Member,
                 on_bucket: Callable[[int], None] | None) -> None:
        self.rx, self.plan, self.member, self.on_bucket = rx, plan, member, on_bucket
        self.version = plan.version
        try:
            root = self.root = rx.root_store(plan.master_addr, plan.master_port)
            self.store = push_store(root, plan.version)
            self.params = json.loads(self.store.get(Keys.PARAMS))
        except (dist.DistNetworkError, dist.DistStoreError) as e:
            rx.drop_root()
            raise WeightSyncAborted(f"weight sync v{plan.version}: sender store at "
                                    f"{plan.master_addr}:{plan.master_port} unreachable ({e})",
                                    version=plan.version) from e
        # blocking waits on the sender's keys end after a step's timeout (see _deadline)
        self.store.set_timeout(timedelta(seconds=self._deadline() - time.monotonic()))
        beat_store = root.clone()  # type: ignore[attr-defined]  # its own connection; not in stubs
        self.heartbeat = Heartbeat(push_store(beat_store, plan.version), member.rank,
                                   self.params["heartbeat_interval_s"])
        self.pg: dist.ProcessGroup | None = None
        self.ntensors = 0
        self.bad: list[str] = []
        self.end: dict = {}
        self.sums: list[torch.Tensor] = []
        self.buckets: list[torch.Tensor] = []
        self.entries: list[list[bk.TensorEntry]] = []
        self.host_blocking = waits_on_host(plan.backend)

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Around one receive: the heartbeat runs; a failure is reported to the sender, the push
        discarded and raised as this member's WeightSyncError; on success the group is kept for
        the next push."""
        self.heartbeat.start()
        try:
            yield
        except WeightSyncAborted:
            self._discard()
            self.rx.drop_root()
            raise
        except (RuntimeError, WaitTimeout) as e:
            self._report(f"{type(e).__name__}: {e}")
            self._discard()
            self.rx.drop_root()
            raise WeightSyncError(f"weight sync v{self.version}: {self.member} failed: {e}",
                                  version=self.version, members=(str(self.member),)) from e
        finally:
            self.heartbeat.stop()
        assert self.pg is not None
        self.rx._group = (self.version, self.pg)

    def run(self) -> ReceivedWeights:
        t0 = time.perf_counter()
        self.refuse_other_nccl()  # before any collective, before joining
        with self.session():
            self._join()
            nbytes = self._receive_all()
            self._ack()
            self._await_commit()
        return ReceivedWeights(self.version, list(zip(self.buckets, self.entries, strict=True)),
                               nbytes, time.perf_counter() - t0)

    def refuse_other_nccl(self) -> None:
        """Before any collective: an NCCL push from another NCCL version is refused, the
        sender told why (it aborts the push naming this member)."""
        why = nccl_mismatch(self.plan.backend, self.params.get("nccl_version", ""),
                            nccl_version(), self.version, str(self.member))
        if why is not None:
            self._report(why)
            raise WeightSyncError(why, version=self.version, members=(str(self.member),))

    def _deadline(self) -> float:
        # The sender decides (and names the culprit) first: it needs up to a heartbeat
        # timeout past its own deadline to diagnose, so receivers wait a little longer.
        grace = self.params["heartbeat_timeout_s"] + 1.0
        return time.monotonic() + self.params["timeout_s"] + grace

    def _check_abort(self) -> None:
        try:
            aborted = self.store.check([Keys.ABORT])
        except RuntimeError as e:
            raise WeightSyncAborted(f"weight sync v{self.version}: sender unreachable ({e})",
                                    version=self.version) from e
        if aborted:
            reason = self.store.get(Keys.ABORT).decode()
            raise WeightSyncAborted(f"weight sync v{self.version} aborted by the sender: "
                                    f"{reason}", version=self.version)

    def _wait_key(self, key: str, store: dist.Store | None = None) -> bytes:
        """Block until the sender writes `key` of this push (or of `store`; it writes
        Keys.ABORTED there on abort); a dead sender drops the connection, a stalled one runs
        into the store timeout."""
        try:
            value = (store or self.store).get(key)
        except dist.DistNetworkError as e:
            raise WeightSyncAborted(f"weight sync v{self.version}: sender unreachable ({e})",
                                    version=self.version) from e
        except dist.DistStoreError as e:
            raise WaitTimeout(f"timed out waiting for {key}") from e
        if value == Keys.ABORTED.encode():
            self._check_abort()
            raise WeightSyncAborted(f"weight sync v{self.version} aborted", version=self.version)
        return value

    def _join(self) -> None:
        reuse, cached = self.params.get("reuse"), self.rx._group
        can_reuse = reuse is not None and cached is not None and cached[0] == reuse
        self.store.set(Keys.join(self.member.rank), f"reuse:{reuse}" if can_reuse else "new")
        if self._wait_key(Keys.GO) == b"reuse":
            assert cached is not None
            self.pg = cached[1]
            return
        self.rx._group = None  # idle (no op in flight): dropped at once
        host = local_addr_toward(self.plan.master_addr)
        self.pg = make_process_group(self.store, self.member.rank,
                                     len(members_of(self.plan)) + 1, self.plan.backend,
                                     self.params["timeout_s"], host)

    def _receive_all(self) -> int:
        """Post the buckets' broadcasts ahead of their data, checksum each as it lands, then
        check every tensor against the checksums of the end header."""
        listed = self.rx.push_layout(self._wait_key(Keys.LAYOUT),
                                     lambda key: self._wait_key(key, self.root))
        staged = self._stage_listed(listed) if listed is not None else self._stage_streamed()
        if staged and not self.host_blocking:  # one wait for the whole push (NCCL: in order)
            wait_work(staged[-1].work, self._check_abort, self._deadline(), gloo=False)
        nbytes = sum(st.bucket.numel() for st in staged)
        if self.end["tensors"] != self.ntensors or self.end["bytes"] != nbytes:
            raise WeightSyncError(f"weight sync v{self.version}: got {self.ntensors} tensors "
                                  f"/ {nbytes} B, the sender announced {self.end}",
                                  version=self.version)
        self.bad = hs.mismatches(self.entries, hs.split_sums(self.sums), self.end["sums"])
        return nbytes

    def _stage_listed(self, listed: list[_Layout]) -> list[_Staged]:
        """Every layout known up front: post every bucket at once, then finish them in order."""
        staged = [self._post_bucket(k, *lay) for k, lay in enumerate(listed)]
        for cur in staged:
            self._finish(cur, last=cur is staged[-1])
        self.end = hd.decode_header(self._wait_key(Keys.header(len(staged))))
        return staged

    def _stage_streamed(self) -> list[_Staged]:
        """Per-bucket headers. gloo: bucket k+1 is posted before k is finished; NCCL: the host
        never waits per bucket (see _finish)."""
        staged: list[_Staged] = []
        cur = self._post(0)
        while cur is not None:
            nxt = self._post(cur.index + 1) if self.host_blocking else None
            self._finish(cur, last=self.host_blocking and nxt is None)
            staged.append(cur)
            cur = nxt if self.host_blocking else self._post(cur.index + 1)
        return staged

    def _post(self, index: int) -> _Staged | None:
        """Read bucket `index`'s header and post its broadcast (None after the last one)."""
        raw = self._wait_key(Keys.header(index))
        layout = self.rx.layout(index, raw)
        if layout is None:
            self.end = hd.decode_header(raw)
            return None
        return self._post_bucket(index, *layout)

    def _post_bucket(self, index: int, nbytes: int, entries: list[bk.TensorEntry],
                     bounds: bk.ChecksumPlan) -> _Staged:
        bucket = self.rx.staging(index, nbytes)
        assert self.pg is not None
        return _Staged(index, entries, bucket, broadcast(self.pg, bucket), bounds)

    def _finish(self, staged: _Staged, last: bool = False) -> None:
        """Bucket received (gloo: host waits, polled) or queued behind it (NCCL: stream
        order): checksum it, expose its tensors as views. The last bucket of a CPU push is
        summed on every idle core: the transport is done, and only this sum and the ack stand
        between its last byte and the commit."""
        if self.host_blocking:
            wait_work(staged.work, self._check_abort, self._deadline(), gloo=True)
        else:
            staged.work.wait()
        with bk.idle_sum_threads() if last else contextlib.nullcontext():
            self.sums.append(bk.checksum_tensor(staged.bucket, staged.entries, staged.bounds))
        self.entries.append(staged.entries)
        self.buckets.append(staged.bucket)
        self.ntensors += len(staged.entries)
        self.heartbeat.progress = staged.index + 1
        if self.on_bucket is not None:
            self.on_bucket(staged.index)

    def _ack(self) -> None:
        if self.bad:
            shown = ", ".join(self.bad[:5])
            msg = f"fail: checksum mismatch in {len(self.bad)} tensor(s): {shown}"
        else:
            msg = "ok"
        self.store.set(Keys.ack(self.member.rank), msg)

    def _await_commit(self) -> None:
        self._wait_key(Keys.COMMIT)
        if self.bad:  # the sender cannot have committed over our failed ack
            raise WeightSyncError(f"weight sync v{self.version}: commit after a failed ack",
                                  version=self.version)

    def _report(self, reason: str) -> None:
        """Tell the sender why we failed (best effort: its store may be gone)."""
        try:
            self.store.set(Keys.err(self.member.rank), reason)
            self.store.add(Keys.ERRORS, 1)
        except RuntimeError:
            log.warning("weight sync v%d: could not report failure to the sender", self.version)

    def _discard(self) -> None:
        self.bad, self.sums, self.entries, self.buckets = [], [], [], []
        self.rx._group = None
        discard(self.pg, [], linger_s=self.params["timeout_s"] + 10)
        self.pg = None
