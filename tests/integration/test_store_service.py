"""The store's gRPC surface in a real process: health, reflection, backpressure hints, watches,
workers, metrics, and bearer-token auth."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from store_fixtures import StoreProcess, wait_until

from services.common.auth import ClientAuth, ClientAuthConfig
from services.common.pb.r3flow.v1 import store_pb2
from services.store.client import StoreClient
from services.store.errors import UnackedFull
from services.store.parts import trajectory_requests
from services.store.redis_server import EmbeddedRedis
from services.store.synthetic import small_group


@pytest.fixture(scope="module")
def tight_store(store_redis: EmbeddedRedis, tmp_path_factory) -> Iterator[StoreProcess]:  # noqa: ANN001
    proc = StoreProcess(store_redis.url, tmp_path_factory.mktemp("tight"), key_prefix="tight:",
                        max_backlog_tokens=20, backpressure_retry_ms=200).start()
    yield proc
    proc.stop()


def test_reflection_lists_store_and_health(store_process: StoreProcess) -> None:
    with grpc.insecure_channel(store_process.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        [resp] = list(stub.ServerReflectionInfo(iter([req])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"r3flow.v1.TrajectoryStore", "grpc.health.v1.Health"} <= names


def test_backpressure_sends_retry_hint_and_client_waits(tight_store: StoreProcess) -> None:
    a, b = small_group("bp", 2)
    raw = StoreClient(tight_store.address, max_backpressure_wait_s=0)
    raw.append(trajectory_requests(a)[:2])           # backlog 8 + 4 = 12 tokens
    raw.append(trajectory_requests(b)[:2])           # 12 <= 20: admitted, backlog 24
    c = small_group("bp2", 1)[0]
    with pytest.raises(grpc.RpcError) as err:
        raw.append_trajectory(c)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(err.value.trailing_metadata())["retry-after-ms"] == "200"
    assert "max_backlog_tokens" in err.value.details()
    # The worker's in-flight trajectories still complete; the trainer drains the backlog,
    # and a patient client's retried begin gets through.
    raw.append(trajectory_requests(a)[2:])
    raw.append(trajectory_requests(b)[2:])
    patient = StoreClient(tight_store.address)
    done = threading.Thread(target=patient.append_trajectory, args=(c,))
    done.start()
    wait_until(lambda: patient.retries >= 1, 10, "a refused begin")
    [g] = raw.pull("t", 1, wait_ms=1000)
    raw.ack("t", [g.delivery_id])
    done.join(10)
    assert not done.is_alive()
    assert raw.pull("t", 1, wait_ms=1000)[0].group_id == "bp2"


def test_watches_push_new_versions_and_plans(store_process: StoreProcess) -> None:
    client = StoreClient(store_process.address)
    client.publish_policy_version(7)
    versions = client.watch_policy_version(known_version=3)
    assert next(versions).version == 7               # older known version: answered at once
    threading.Timer(0.2, client.publish_policy_version, args=(8,)).start()
    assert next(versions).version == 8               # pushed when published
    plans = client.watch_weight_sync("w1", known_version=-1)
    client.register_worker("w1", "10.0.0.1", world_size=2, policy_version=8)
    client.publish_weight_sync(store_pb2.WeightSyncPlan(
        version=9, master_addr="10.0.0.9", master_port=29500,
        members=client.list_workers(), backend="gloo"))
    plan = next(plans)
    assert (plan.version, [m.worker_id for m in plan.members]) == (9, ["w1"])
    assert client.unregister_worker("w1") is True  # a graceful shutdown: out of the next plan
    assert [w.worker_id for w in client.list_workers()] == []
    assert client.unregister_worker("w1") is False


def test_metrics_and_health_endpoints(store_process: StoreProcess) -> None:
    client = StoreClient(store_process.address)
    current = client.stats().policy_version  # older groups would be dropped as stale
    for traj in small_group("metrics", 2, seed=4, policy_version=current):
        client.append_trajectory(traj)
    [g] = client.pull("m", 1, wait_ms=500)
    client.ack("m", [g.delivery_id])
    base = f"http://127.0.0.1:{store_process.metrics_port}"
    text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
    assert 'r3flow_store_appends_total{kind="segment"}' in text
    assert "r3flow_store_groups_acked_total 1.0" in text
    assert "r3flow_store_routing_encoded_bytes_total" in text
    assert "r3flow_store_pull_seconds_count" in text
    assert urllib.request.urlopen(f"{base}/health", timeout=5).status == 200


def test_bearer_token_required_when_configured(store_redis: EmbeddedRedis, tmp_path) -> None:  # noqa: ANN001
    token = tmp_path / "trainer.token"
    token.write_text("s3cret\n")
    proc = StoreProcess(store_redis.url, tmp_path, key_prefix="auth:",
                        auth={"token_files": {"trainer": str(token)}}).start()
    try:
        with pytest.raises(grpc.RpcError) as err:
            StoreClient(proc.address, max_retries=0).stats()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        auth = ClientAuth.from_config(ClientAuthConfig(token_file=str(token)))
        assert StoreClient(proc.address, auth=auth).stats().groups_acked == 0
    finally:
        proc.stop()


def test_pulled_trajectories_name_their_prompt_source(store_redis: EmbeddedRedis,
                                                      tmp_path) -> None:  # noqa: ANN001
    # worker_id, prompt_id and epoch go in with the begin and come out with the pull (the
    # trainer's ledger records them: which pod's shard, which pass over it)
    proc = StoreProcess(store_redis.url, tmp_path, key_prefix="source:").start()
    try:
        with StoreClient(proc.address) as client:
            group = small_group("source", 2, seed=5)
            for traj in group:
                traj.worker_id, traj.prompt_id, traj.epoch = "rollout-1", "p42", 3
            client.append_trajectories(group)
            [g] = client.pull("source", 4, wait_ms=2000)
            assert {(t.worker_id, t.prompt_id, t.epoch) for t in g.trajectories} == {
                ("rollout-1", "p42", 3)}
    finally:
        proc.stop()


def test_append_batch_is_an_append_stream_in_one_message(store_process: StoreProcess) -> None:
    """Groups in one AppendBatch: validated whole (one bad trajectory writes nothing, the error
    names it), then stored; sent again, every message is a duplicate."""
    good = small_group("batch-a", 2) + small_group("batch-b", 2)
    bad = small_group("batch-c", 2)
    bad[1].segments[1].logprobs.append(-1.0)  # one logprob more than tokens
    with StoreClient(store_process.address) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.append_trajectories(good + bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "batch-c/1" in err.value.details()
        res = client.append_trajectories(good)
        assert (res.accepted, res.duplicates) == (16, 0)  # 4 x (begin, 2 segments, finish)
        again = client.append_trajectories(good)
        assert (again.accepted, again.duplicates) == (0, 16)
        assert client._append_batch  # the store has the method: no stream was needed


def test_unacked_bound_over_grpc(store_redis: EmbeddedRedis, tmp_path, caplog) -> None:  # noqa: ANN001
    """A refused append is a WARNING naming the limit and the numbers (then retried); a pull
    refused for un-acked groups raises UnackedFull at once, unretried; an ack makes room."""
    store = StoreProcess(store_redis.url, tmp_path, key_prefix="unacked:", max_backlog_tokens=20,
                         max_unacked_tokens=20, backpressure_retry_ms=100).start()
    try:
        client = StoreClient(store.address, max_backpressure_wait_s=0.3)
        client.append_trajectories(small_group("u1", 2))  # 30 tokens undelivered
        with caplog.at_level("WARNING", logger="services.store.client"), \
                pytest.raises(grpc.RpcError):
            client.append_trajectories(small_group("u2", 2, seed=1))
        [warning] = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert "max_backlog_tokens=20 (held: 30 tokens undelivered, 0 delivered" in warning
        [first] = client.pull("t", 1)  # delivered: the budget admits again
        client.append_trajectories(small_group("u2", 2, seed=1))
        with pytest.raises(UnackedFull, match="max_unacked_tokens=20"):
            client.pull("t", 1)
        assert client.ack("t", [first.delivery_id]) == 1
        assert client.pull("t", 1)[0].group_id == "u2"
    finally:
        store.stop()


def test_pull_chunks_delivers_a_group_larger_than_any_message(
        store_redis: EmbeddedRedis, tmp_path) -> None:  # noqa: ANN001
    """A group over max_pull_message_bytes (and trajectories over max_message_bytes): appended
    in parts, pulled as parts of one chunk each (issue 54); the whole-group Pull cannot send it."""
    proc = StoreProcess(store_redis.url, tmp_path, key_prefix="chunks:",
                        max_message_bytes=12 << 10, max_pull_message_bytes=25 << 10).start()
    try:
        groups = [small_group(g, 2, prompt_len=16, segment_lengths=(40, 30, 20), layers=48,
                              topk=8, num_experts=128, seed=i) for i, g in enumerate("ab")]
        assert all(sum(t.ByteSize() for t in g) > 25 << 10 for g in groups)
        with StoreClient(proc.address) as client:
            for t in groups[0] + groups[1]:
                client.append_in_parts(t, part_bytes=4 << 10)
            [got] = client.pull("trainer", 1, wait_ms=2000)
            assert list(got.trajectories) == groups[0]
            with grpc.insecure_channel(proc.address) as ch:
                whole = ch.unary_stream("/r3flow.v1.TrajectoryStore/Pull")
                with pytest.raises(grpc.RpcError):
                    list(whole(store_pb2.PullRequest(consumer="old", max_groups=1)
                               .SerializeToString(), timeout=30))
            assert client.ack("trainer", [got.delivery_id]) == 1
    finally:
        proc.stop()
