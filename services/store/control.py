"""Control plane kept in Redis next to the trajectories: worker registrations (with a TTL)
and the latest weight-sync plan, the rendezvous of the trainer -> rollout weight push."""

from __future__ import annotations

from typing import Any

import redis

from services.common.pb.r3flow.v1 import store_pb2
from services.store import lua
from services.store.keys import Keys


class ControlPlane:
    """RegisterWorker / UnregisterWorker / ListWorkers / PublishWeightSync / latest plan."""

    def __init__(self, client: redis.Redis, keys: Keys, worker_ttl_seconds: int) -> None:
        self.r: Any = client  # redis-py's annotations mix sync and async replies
        self.keys = keys
        self.ttl = worker_ttl_seconds
        self._set_plan = client.register_script(lua.SET_PLAN)

    def register_worker(self, info: store_pb2.WorkerInfo) -> int:
        """Store (or renew) a worker's registration; returns its TTL in seconds."""
        if not info.worker_id:
            raise ValueError("worker_id: required")
        if info.world_size < 1:
            raise ValueError(f"world_size: {info.world_size} < 1")
        self.r.set(self.keys.worker(info.worker_id), info.SerializeToString(), ex=self.ttl)
        return self.ttl

    def unregister_worker(self, worker_id: str) -> bool:
        """Drop a worker's registration; False if there was none."""
        if not worker_id:
            raise ValueError("worker_id: required")
        return bool(self.r.delete(self.keys.worker(worker_id)))

    def list_workers(self) -> list[store_pb2.WorkerInfo]:
        """Registered workers that have not expired, sorted by id."""
        names = sorted(self.r.scan_iter(match=self.keys.worker_pattern, count=500))
        blobs = self.r.mget(names) if names else []
        return [store_pb2.WorkerInfo.FromString(b) for b in blobs if b is not None]

    def publish_weight_sync(self, plan: store_pb2.WeightSyncPlan) -> None:
        """Store a plan if its version is newer; re-publishing the current one is a no-op."""
        stored = int(self._set_plan(keys=[self.keys.weight_sync],
                                    args=[plan.version, plan.SerializeToString()]))
        if stored > plan.version:
            raise ValueError(f"version: {plan.version} is older than the published {stored}")

    def latest_weight_sync(self) -> store_pb2.WeightSyncPlan | None:
        blob = self.r.hget(self.keys.weight_sync, "plan")
        return store_pb2.WeightSyncPlan.FromString(blob) if blob else None
