"""The chart's release in the box: its pods serve at their pod addresses and its NetworkPolicies
are enforced (the store reaches Redis by Service name with auth; a rollout pod does not reach
Redis; a rollout pod reaches the store)."""

from __future__ import annotations

from cluster import Cluster, eventually


def test_release_policies(cluster: Cluster):
    c = cluster
    redis, store = c.by_name("r3flow-redis")[0], c.by_name("r3flow-store")[0]
    rollout = c.by_name("r3flow-rollout")[0]
    assert c.connect(store, redis.ip, 6379), "store -> redis must be allowed"
    assert not c.connect(rollout, redis.ip, 6379), "rollout -> redis must be denied"
    assert eventually(lambda: c.connect(rollout, store.ip, 50051), 90), "rollout -> store"
