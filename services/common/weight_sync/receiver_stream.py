"""Rollout side, streamed: `stream_weights(rx, plan)` yields each bucket's tensors as the bucket
lands, for a loader that copies them into the engine's parameters on the fly (vLLM's
`load_weights` takes an iterator), so an engine rank never stages the whole model: buckets go
through a ring of `slots` staging buffers (the largest bucket each), reused across pushes.

The checksums are still verified (each bucket summed as it lands, compared with the end header)
and acked, and the generator returns only after the sender's commit. What differs from
`WeightReceiver.receive`: the tensors reach the parameters before the commit, so a failed or
aborted push (raised from the generator, through the loader) leaves the engine's weights torn;
the caller must not serve from them until the next push completes.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from services.common.pb.r3flow.v1 import store_pb2
from services.common.weight_sync import buckets as bk
from services.common.weight_sync import headers as hd
from services.common.weight_sync import sums as hs
from services.common.weight_sync.group import (
    Keys,
    WeightSyncError,
    broadcast,
    rank_in,
    wait_work,
)
from services.common.weight_sync.receiver import WeightReceiver, _Layout, _Receive, _Staged

DEFAULT_SLOTS = 3  # one bucket on the wire, one being loaded, one spare for the loader's lag


class _Ring:
    """`slots` staging buffers, bucket k in slot k % slots, grown to the largest bucket."""

    def __init__(self, rx: WeightReceiver, slots: int) -> None:
        if slots < 2:
            raise ValueError(f"slots: {slots} < 2 (one landing while one is loaded)")
        self.rx, self.slots = rx, slots
        self.buffers = rx.ring_buffers[:slots]

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        slot = index % self.slots
        while len(self.buffers) <= slot:
            self.buffers.append(torch.empty(0, dtype=torch.uint8, device=self.rx.device))
        if self.buffers[slot].numel() < nbytes:
            self.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.rx.device)
        self.rx.ring_buffers = self.buffers  # kept by the receiver: K buckets, not the model
        return self.buffers[slot][:nbytes]


class _StreamReceive(_Receive):
    """One streamed receive: buckets posted `slots - 2` ahead, each yielded once it landed."""

    def __init__(self, rx: WeightReceiver, plan: store_pb2.WeightSyncPlan, slots: int) -> None:
        super().__init__(rx, plan, rank_in(plan, rx.worker_id, rx.local_rank), None)
        self.ring = _Ring(rx, slots)
        self.nbytes = 0

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.refuse_other_nccl()  # before any collective, before joining
        with self.session():
            self._join()
            yield from self._buckets()
            self._check_end()
            self._ack()
            self._await_commit()

    def _buckets(self) -> Iterator[tuple[str, torch.Tensor]]:
        listed = self.rx.push_layout(self._wait_key(Keys.LAYOUT),
                                     lambda key: self._wait_key(key, self.root))
        ahead = self.ring.slots - 2
        posted: list[_Staged] = []
        index = 0
        while True:
            while len(posted) <= ahead and index >= 0:
                staged = self._post_next(index, listed)
                index = -1 if staged is None else index + 1
                if staged is not None:
                    posted.append(staged)
            if not posted:
                return
            cur = posted.pop(0)
            if self.host_blocking:
                wait_work(cur.work, self._check_abort, self._deadline(), gloo=True)
            else:
                cur.work.wait()  # the current stream waits: loads queue behind the bucket
            self.sums.append(bk.checksum_tensor(cur.bucket, cur.entries, cur.bounds))
            self.entries.append(cur.entries)
            self.ntensors += len(cur.entries)
            self.nbytes += cur.bucket.numel()
            self.heartbeat.progress = cur.index + 1
            views = bk.bucket_views(cur.bucket, cur.entries)
            yield from zip((e.name for e in cur.entries), views, strict=True)

    def _post_next(self, index: int, listed: list[_Layout] | None) -> _Staged | None:
        """Post bucket `index`'s broadcast into its ring slot (None: there is none)."""
        if listed is not None:
            if index == len(listed):
                self.end = hd.decode_header(self._wait_key(Keys.header(index)))
                return None
            layout = listed[index]
        else:
            raw = self._wait_key(Keys.header(index))
            got = self.rx.layout(index, raw)
            if got is None:
                self.end = hd.decode_header(raw)
                return None
            layout = got
        nbytes, entries, bounds = layout
        bucket = self.ring.get(index, nbytes)
        assert self.pg is not None
        return _Staged(index, entries, bucket, broadcast(self.pg, bucket), bounds)

    def _check_end(self) -> None:
        if self.end["tensors"] != self.ntensors or self.end["bytes"] != self.nbytes:
            raise WeightSyncError(f"weight sync v{self.version}: got {self.ntensors} tensors "
                                  f"/ {self.nbytes} B, the sender announced {self.end}",
                                  version=self.version)
        self.bad = hs.mismatches(self.entries, hs.split_sums(self.sums), self.end["sums"])


def stream_weights(rx: WeightReceiver, plan: store_pb2.WeightSyncPlan,
                   slots: int = DEFAULT_SLOTS) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in the wire dtype) of `plan`'s push as each bucket lands, through `rx`'s
    group and a ring of `slots` staging buffers; each tensor is valid until `slots - 1` more
    buckets were drawn (load it at once). Returns after the commit; raises as `rx.receive`
    does (then the weights loaded so far are torn)."""
    return _StreamReceive(rx, plan, slots).tensors()


def staged_bytes(rx: WeightReceiver) -> int:
    """Bytes of staging `rx` keeps between streamed pushes (the ring)."""
    return sum(b.numel() for b in rx.ring_buffers)
