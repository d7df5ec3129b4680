"""Trainer side: `WeightSender` hosts the rendezvous store, turns registered workers into a
`WeightSyncPlan`, and pushes HF-named tensors to every member with a two-phase commit:
stream checksummed buckets -> every member acks "verified" -> write `commit` (or `abort`).
One push's execution (group, buckets in flight, acks) is `weight_sync.push.Push`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from services.common.pb.r3flow.v1 import store_pb2
from services.common.weight_sync import buckets as bk
from services.common.weight_sync.group import (
    CachedGroup,
    Keys,
    connect_store,
    group_signature,
    nccl_version,
    push_store,
)
from services.common.weight_sync.layout import BucketLayout, PackedLayout, StreamLayout
from services.common.weight_sync.push import Push, PushReport

__all__ = ["STANDALONE_ADDR", "PushReport", "WeightSender"]

if TYPE_CHECKING:  # the sender only reads attributes: the GPU bench runs without pydantic
    from services.common.weight_sync.config import WeightSyncConfig

# Where a sender without an advertise_addr listens. The trainer never leaves it empty: its rank 0
# advertises its node's address (trainer/ranks/worker.py).
STANDALONE_ADDR = "127.0.0.1"


class WeightSender:
    """Rank 0 of every weight-sync group; one per trainer process that exports weights."""

    def __init__(self, cfg: WeightSyncConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.wire = bk.wire_dtype(cfg.wire_dtype)
        self.bucket_bytes = cfg.bucket_bytes or bk.default_bucket_bytes(cfg.backend)
        self.direct_min_bytes = cfg.direct_min_bytes or self.bucket_bytes // 2
        # empty: a standalone sender (tests, benches) on one machine
        self.addr = cfg.advertise_addr or STANDALONE_ADDR
        self._root = connect_store(self.addr, cfg.port, cfg.timeout_s, server=True)
        self._pool: list[torch.Tensor | None] = [None] * cfg.inflight_buckets
        self._last_version: int | None = None
        self._pushed_version: int | None = None
        # The last good push's group, kept while membership does not change: NCCL
        # communicator setup costs far more than a push (see docs/weight_sync.md).
        self._group: CachedGroup | None = None
        self._reuse: int | None = None
        self._layout: BucketLayout | None = None  # the last pushed sequence's buckets
        self._layout_digest = ""  # the layout last written to the root store
        self._streamed = StreamLayout()  # the last streamed (generator) push's buckets
        self._packed = PackedLayout()  # the last push of packed buckets' headers
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def port(self) -> int:
        return self._root.port

    def plan(self, version: int, workers: Sequence[store_pb2.WorkerInfo]) -> store_pb2.WeightSyncPlan:
        """The plan to publish (store `publish_weight_sync`) before calling `push`."""
        if self._last_version is not None and version <= self._last_version:
            raise ValueError(f"version: {version} must exceed the last push's {self._last_version}")
        if not workers:
            raise ValueError("workers: a weight-sync plan needs at least one member")
        plan = store_pb2.WeightSyncPlan(
            version=version, master_addr=self.addr, master_port=self.port,
            members=list(workers), backend=self.cfg.backend, wire_dtype=self.cfg.wire_dtype,
            bucket_bytes=self.bucket_bytes)
        g = self._group
        self._reuse = g.version if g is not None and g.signature == group_signature(plan) else None
        params = {"timeout_s": self.cfg.timeout_s,
                  "heartbeat_interval_s": self.cfg.heartbeat_interval_s,
                  "heartbeat_timeout_s": self.cfg.heartbeat_timeout_s, "reuse": self._reuse,
                  "nccl_version": nccl_version()}
        push_store(self._root, version).set(Keys.PARAMS, json.dumps(params))
        self._last_version = version
        return plan

    def push(self, plan: store_pb2.WeightSyncPlan,
             named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
             | Iterable[bk.PackedBucket]) -> PushReport:
        """Send `named` to every member of `plan`. A list / dict / dict.items() reuses the
        last push's bucket layout when names, shapes and dtypes repeat; a generator streams
        (tensors are packed as they come; the buckets are reused while the tensors repeat);
        a generator of `bk.PackedBucket`s (its producer packed them) sends each as it is.

        Returns once every member verified every tensor and the commit key is written.
        Raises WeightSyncError naming the failed member(s); then every receiver discards.
        """
        if plan.version != self._last_version or plan.master_port != self.port:
            raise ValueError(f"plan: v{plan.version} was not made by this sender's last plan()")
        if plan.version == self._pushed_version:  # its keys (an abort, say) are still there
            raise ValueError(f"plan: v{plan.version} was pushed already; make a new plan")
        self._pushed_version = plan.version
        return Push(self, plan).run(named)

    def close(self) -> None:
        self._pool = [None] * self.cfg.inflight_buckets
        self._group, self._layout, self._streamed = None, None, StreamLayout()
        self._packed = PackedLayout()
        del self._root
