"""The trainer's side of the weight push: plan from the store's registered workers, publish it,
broadcast the exported HF weights (services.common.weight_sync), report the new version.

The sender is trainer rank 0 (`RankSender`, inside the rank's process: on a cluster, on its own
node with its own GPU), advertising its node's address and the configured port. The driver only
lists the workers and publishes the plan (a few hundred bytes): the exported weights never leave
rank 0's process, never pass through the Ray object store or the head pod.

  driver                                   rank 0 (every rank joins the EP export gather)
  list_workers ──► plan_push(version, workers) ──► WeightSender.plan ──► plan bytes
  publish_weight_sync(plan)
               ──► push_weights(plan) ──► iter_hf_weights (streamed to rank 0) ──► WeightSender.push

A push to zero registered workers is skipped (logged): rollout pods may come and go.
A failed push is reported (the member named) and counted; the next push re-forms the group.
A member whose worker leaves the store (unregisters: a rollout pod stopping) before it joined
fails the push at once (`LeaverWatch`), instead of the push waiting out weight_sync.timeout_s.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from services.common.weight_sync import WeightSyncConfig
    from trainer.loop.ranks import Ranks

log = logging.getLogger(__name__)


class RankSender:
    """Rank 0's weight-sync sender: `plan` then `push`; failures come back as a result dict."""

    def __init__(self, cfg: WeightSyncConfig, advertise_addr: str) -> None:
        from services.common.weight_sync import WeightSender

        if not advertise_addr:
            raise ValueError("weight_sync.advertise_addr: no address to advertise")
        self.cfg = cfg.model_copy(update={"advertise_addr": advertise_addr})
        self.sender = WeightSender(self.cfg)
        log.info("weight-sync sender on %s:%d", advertise_addr, self.sender.port)

    def plan(self, version: int, workers_bytes: list[bytes]) -> bytes:
        """The serialized plan for `version` to the given workers (WorkerInfo bytes)."""
        from services.common.pb.r3flow.v1 import store_pb2

        workers = [store_pb2.WorkerInfo.FromString(b) for b in workers_bytes]
        return self.sender.plan(version, workers).SerializeToString()

    def push(self, plan_bytes: bytes,
             weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
             ) -> dict[str, Any]:
        """Send `weights` (a stream, packed as it comes; or a dict); {"ok": True, report...}
        or {"ok": False, "error", "members"}."""
        from services.common.pb.r3flow.v1 import store_pb2
        from services.common.weight_sync import WeightSyncError

        plan = store_pb2.WeightSyncPlan.FromString(plan_bytes)
        if isinstance(weights, Mapping):
            weights = weights.items()
        digests: dict[str, str] = {}
        if self.cfg.export_digests_dir:
            weights = digesting(self.cfg, weights, digests)
        try:
            r = self.sender.push(plan, iter(weights))
        except WeightSyncError as e:
            return {"ok": False, "error": str(e), "members": list(e.members)}
        if self.cfg.export_digests_dir:
            write_export_digests(self.cfg, plan.version, digests)
        return {"ok": True, "version": r.version, "members": list(r.members),
                "num_tensors": r.num_tensors, "num_bytes": r.num_bytes, "seconds": r.seconds,
                "gb_s": r.gb_s, "address": f"{plan.master_addr}:{plan.master_port}"}

    def close(self) -> None:
        self.sender.close()


def digesting(cfg: WeightSyncConfig, weights: Iterable[Any], into: dict[str, str]
              ) -> Iterator[Any]:
    """`weights` ((name, tensor) pairs or packed buckets) passed through, the digest of each
    tensor as it goes on the wire (floating ones cast to the wire dtype) recorded in `into`."""
    from services.common.weight_sync.buckets import (
        PackedBucket,
        bucket_views,
        dtype_on_wire,
        wire_dtype,
    )
    from services.common.weight_sync.digest import tensor_digest

    wire = wire_dtype(cfg.wire_dtype)
    for item in weights:
        if isinstance(item, PackedBucket):  # already in the wire dtypes
            views = bucket_views(item.buffer, list(item.entries))
            into |= {e.name: tensor_digest(v) for e, v in zip(item.entries, views, strict=True)}
        else:
            name, t = item
            into[name] = tensor_digest(t.to(dtype_on_wire(t.dtype, wire)))
        yield item


def write_export_digests(cfg: WeightSyncConfig, version: int, digests: Mapping[str, str]) -> Path:
    """`<export_digests_dir>/v<version>.json` ({"version", "digests": HF name -> digest}),
    written atomically."""
    d = Path(cfg.export_digests_dir)
    d.mkdir(parents=True, exist_ok=True)
    target = d / f"v{version}.json"
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"version": version, "digests": dict(digests)}))
    os.replace(tmp, target)
    return target


class StoreWeightPush:
    """`TrainLoop.push_fn(ranks, version, run_id)`: rank 0 of `ranks` sends (see the module docstring).

    `Ranks.plan_push(version, workers)` and `Ranks.push_weights(plan)` (trainer.ranks.worker); every
    rank takes part in `push_weights` (the export is a collective), only rank 0 answers."""

    def __init__(self, client, failure_counter=None) -> None:
        self.failures = 0
        self.failure_counter = failure_counter
        self.client = client
        self.last_report: dict[str, Any] | None = None

    def __call__(self, ranks: Ranks, version: int, run_id: str = "") -> None:
        workers = self.client.list_workers()
        if not workers:
            log.warning("weight push v%d skipped: no rollout worker registered", version)
            return
        from services.common.pb.r3flow.v1 import store_pb2

        plan_bytes = ranks.plan_push(version, [w.SerializeToString() for w in workers])
        plan = store_pb2.WeightSyncPlan.FromString(plan_bytes)
        plan.run_id = run_id  # the receivers tag the groups they begin with it
        plan_bytes = plan.SerializeToString()
        self.client.publish_weight_sync(plan)
        with LeaverWatch(self.client, plan):
            result = ranks.push_weights(plan_bytes)
        if not result["ok"]:
            # Every receiver discards an aborted push (two-phase commit), so the engines stay
            # consistent on the old version; the next push re-forms the group from whoever
            # is registered then. Training goes on; staleness limits what old rollouts cost.
            self.failures += 1
            if self.failure_counter is not None:
                self.failure_counter.inc()
            log.error("weight push v%d failed, engines keep their weights: %s (members %s)",
                      version, result["error"], result["members"])
            return
        self.last_report = result
        log.info("pushed v%d from %s to %d worker(s): %.1f MB in %.2fs (%.2f GB/s)", version,
                 result["address"], len(workers), result["num_bytes"] / 1e6, result["seconds"],
                 result["gb_s"])


class LeaverWatch:
    """While a push runs (`with LeaverWatch(client, plan): push`): every LEFT_CHECK_S, the
    members whose worker is no longer registered in the store and has not joined are reported
    failed on their behalf in the push's rendezvous store (the error key a receiver writes), so
    the sender ends the push at once, naming them. A rollout worker that stops unregisters; a
    push planned just before that waited out weight_sync.timeout_s (120 s) for it, and the
    trainer's SIGTERM waited behind the push (test_sigterm_stop: trainer stopped in 60 s+)."""

    LEFT_CHECK_S = 1.0
    REASON = "left the store (unregistered) before joining the push"

    def __init__(self, client, plan) -> None:  # noqa: ANN001 (StoreClient, WeightSyncPlan)
        from services.common.weight_sync.group import members_of

        self.client, self.plan, self.members = client, plan, members_of(plan)
        self.reported: list[str] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="push-leavers", daemon=True)

    def __enter__(self) -> LeaverWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(self.LEFT_CHECK_S):
            try:
                registered = {w.worker_id for w in self.client.list_workers()}
            except Exception as e:  # noqa: BLE001 (the store restarting: the push decides)
                log.debug("leaver check: list workers failed: %s", e)
                continue
            gone = [m for m in self.members if m.worker_id not in registered]
            if gone:
                try:
                    self._report(gone)
                except Exception as e:  # noqa: BLE001 (the push ended and its store with it)
                    log.debug("leaver check: could not report %s: %s", gone, e)
                return

    def _report(self, gone: list) -> None:
        from services.common.weight_sync.group import Keys, connect_store, push_store

        if self._done.is_set():
            return
        root = connect_store(self.plan.master_addr, self.plan.master_port, 5.0, server=False)
        store = push_store(root, self.plan.version)
        for m in gone:
            if store.check([Keys.join(m.rank)]):
                continue  # joined: a member gone mid-push shows as a stale heartbeat
            store.set(Keys.err(m.rank), self.REASON)
            store.add(Keys.ERRORS, 1)
            self.reported.append(str(m))
        if self.reported:
            log.warning("weight push v%d: %s %s", self.plan.version, ", ".join(self.reported),
                        self.REASON)
