"""Control plane kept in Redis next to the trajectories: worker registrations (with a TTL),
the trainer's presence (with a TTL) and the latest weight-sync plan, the rendezvous of the
trainer -> rollout weight push."""

from __future__ import annotations

from typing import Any

import redis

from services.common.pb.r3flow.v1 import store_pb2
from services.store import lua
from services.store.keys import Keys


class ControlPlane:
    """RegisterWorker / UnregisterWorker / ListWorkers / PublishWeightSync / latest plan."""

    def __init__(self, client: redis.Redis, keys: Keys, worker_ttl_seconds: int,
                 trainer_ttl_seconds: int = 30) -> None:
        self.r: Any = client  # redis-py's annotations mix sync and async replies
        self.keys = keys
        self.ttl = worker_ttl_seconds
        self.trainer_ttl = trainer_ttl_seconds
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

    def trainer_heartbeat(self, presence: store_pb2.TrainerPresence) -> int:
        """A trainer is present (for trainer_ttl seconds) or leaving; returns the TTL."""
        if not presence.consumer:
            raise ValueError("consumer: required (names the trainer)")
        with self.r.pipeline(transaction=True) as p:
            p.set(self.keys.trainer_seen, 1)
            if presence.leaving:
                p.delete(self.keys.trainer)
            else:
                p.set(self.keys.trainer, presence.SerializeToString(), ex=self.trainer_ttl)
            p.execute()
        return self.trainer_ttl

    def trainer_gone(self) -> bool:
        """A trainer was present and is not now (it left, or its presence expired)."""
        with self.r.pipeline(transaction=False) as p:
            p.exists(self.keys.trainer_seen)
            p.exists(self.keys.trainer)
            seen, present = p.execute()
        return bool(seen) and not present

    def publish_weight_sync(self, plan: store_pb2.WeightSyncPlan) -> None:
        """Store a plan if its version is newer; re-publishing the current one is a no-op."""
        stored = int(self._set_plan(keys=[self.keys.weight_sync],
                                    args=[plan.version, plan.SerializeToString()]))
        if stored > plan.version:
            raise ValueError(f"version: {plan.version} is older than the published {stored}")

    def latest_weight_sync(self) -> store_pb2.WeightSyncPlan | None:
        blob = self.r.hget(self.keys.weight_sync, "plan")
        return store_pb2.WeightSyncPlan.FromString(blob) if blob else None
