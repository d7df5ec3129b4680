"""Fuzz the TrajectoryStore gRPC API: 10,000 malformed requests against a real store process over
a real redis-server, sent raw (bytes) through generic channel methods from parallel channels.

Checked: every bad request gets INVALID_ARGUMENT or RESOURCE_EXHAUSTED with a message that starts
with the name of the offending field or message; the server answers health checks throughout;
Redis holds no key from them; the store's RSS is sampled at 2k/6k/10k requests and must level off.
The figures are printed and written to runs/reliability/bad_input.json (RELIABILITY.md).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis
from fuzz_cases import (
    PUBLISHED_PLAN,
    SENTINEL_ID,
    TRANSPORT_CAP,
    Case,
    base_streams,
    make_case,
    oversize_append,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from store_fixtures import REPO, StoreProcess

from services.common.pb.r3flow.v1 import routing_pb2, store_pb2, trajectory_pb2
from services.store.client import StoreClient
from services.store.redis_server import EmbeddedRedis
from services.store.wire_metadata import APPEND_MESSAGES_KEY

PREFIX = "fz:"
TOTAL = 10_400  # ~2% are well-formed acks of unknown ids (acked=0 by design): >= 10k malformed
THREADS = 4
SAMPLES = (2_000, 6_000, 10_000)
SERVICE = "/r3flow.v1.TrajectoryStore/"
BAD = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
RESULTS = REPO / "runs" / "reliability" / "bad_input.json"


def _known_names() -> set[str]:
    """Every field and message name of the wire contract (what an error message may start with)."""
    names = {"stream"}
    todo = [m for f in (store_pb2, trajectory_pb2, routing_pb2)
            for m in f.DESCRIPTOR.message_types_by_name.values()]
    while todo:
        m = todo.pop()
        names.add(m.name)
        names.update(f.name for f in [*m.fields, *m.oneofs])
        todo.extend(m.nested_types)
    return names


KNOWN = _known_names()


@pytest.fixture(scope="module")
def fuzz_store(store_redis: EmbeddedRedis, tmp_path_factory) -> Iterator[StoreProcess]:  # noqa: ANN001
    proc = StoreProcess(store_redis.url, tmp_path_factory.mktemp("fuzz"), key_prefix=PREFIX,
                        max_message_bytes=16384, max_tokens_per_trajectory=64,
                        grpc_workers=16).start()
    with StoreClient(proc.address) as client:  # a plan the stale-version requests fall behind
        client.publish_weight_sync(store_pb2.WeightSyncPlan(version=PUBLISHED_PLAN))
    yield proc
    proc.stop()


class Fuzzer:
    """Sends cases from THREADS channels, records outcomes, samples RSS and health."""

    def __init__(self, store: StoreProcess) -> None:
        self.store = store
        self.bases = base_streams(32)
        self.lock = threading.Lock()
        self.done = 0
        self.codes: Counter[str] = Counter()
        self.by_kind: dict[str, Counter[str]] = {}
        self.example: dict[str, str] = {}  # first error message per kind
        self.wrong: list[str] = []  # code or message not as required
        self.sentinel_hits = 0
        self.rss_mb: dict[int, float] = {}
        self.health: dict[int, bool] = {}

    def call(self, ch: grpc.Channel, case: Case) -> tuple[grpc.StatusCode, str, object]:
        try:
            if case.method == "Append":
                msgs = case.payload if isinstance(case.payload, list) else [case.payload]
                res = ch.stream_unary(SERVICE + "Append")(iter(msgs), timeout=30)
            elif case.method == "Pull":
                res = list(ch.unary_stream(SERVICE + "Pull")(case.payload, timeout=30))
            else:
                res = ch.unary_unary(SERVICE + case.method)(case.payload, timeout=30)
            return grpc.StatusCode.OK, "", res
        except grpc.RpcError as e:
            return e.code(), e.details() or "", None

    def judge(self, case: Case, code: grpc.StatusCode, details: str, res: object) -> str | None:
        if case.expect_ok:
            ok = code == grpc.StatusCode.OK and store_pb2.AckResponse.FromString(res).acked == 0
            return None if ok else f"{case.kind}: {code.name} {details[:120]}"
        if code not in BAD:
            return f"{case.kind}/{case.method}: {code.name} {details[:160]}"
        head = re.match(r"[A-Za-z_]+", details)
        if head is None or head.group(0) not in KNOWN:
            return f"{case.kind}: message names no field: {details[:160]}"
        return None

    def record(self, case: Case, code: grpc.StatusCode, details: str, res: object) -> None:
        verdict = self.judge(case, code, details, res)
        with self.lock:
            self.codes[code.name] += 1
            self.by_kind.setdefault(case.kind, Counter())[code.name] += 1
            self.example.setdefault(case.kind, details[:100])
            self.sentinel_hits += case.sentinel and f"trajectory_id={SENTINEL_ID!r}" in details
            if verdict:
                self.wrong.append(verdict)
            self.done += 1
            sample = self.done in SAMPLES
        if sample:
            self.sample(self.done)

    def sample(self, n: int) -> None:
        status = Path(f"/proc/{self.store.proc.pid}/status").read_text()
        self.rss_mb[n] = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
        with grpc.insecure_channel(self.store.address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=10)
        self.health[n] = resp.status == health_pb2.HealthCheckResponse.SERVING

    def worker(self, seed: int, n: int) -> None:
        rng = np.random.default_rng(seed)
        opts = [("grpc.max_send_message_length", 1 << 30)]
        with grpc.insecure_channel(self.store.address, options=opts) as ch:
            for _ in range(n):
                case = make_case(rng, self.bases)
                self.record(case, *self.call(ch, case))

    def run(self) -> float:
        t0 = time.monotonic()
        threads = [threading.Thread(target=self.worker, args=(1000 + i, TOTAL // THREADS))
                   for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - t0


def _keys(url: str) -> tuple[set[bytes], int]:
    r = redis.Redis.from_url(url)
    try:
        return set(r.scan_iter(match="*", count=1000)), int(r.dbsize())
    finally:
        r.close()


def test_fuzzed_requests_are_refused_and_leave_nothing(fuzz_store: StoreProcess) -> None:
    keys_before, size_before = _keys(fuzz_store.redis_url)
    fz = Fuzzer(fuzz_store)
    seconds = fz.run()
    keys_after, size_after = _keys(fuzz_store.redis_url)
    leaked = sorted(k.decode(errors="replace") for k in keys_after - keys_before)
    by_design = fz.by_kind.get("ack_unknown_id", Counter()).total()
    report = {
        "requests": fz.done, "malformed": fz.done - by_design, "ok_by_design": by_design,
        "seconds": round(seconds, 1), "threads": THREADS,
        "codes": dict(fz.codes), "by_kind": {k: dict(v) for k, v in sorted(fz.by_kind.items())},
        "example_message": dict(sorted(fz.example.items())), "wrong": len(fz.wrong), "wrong_examples": fz.wrong[:10],
        "refused_only_by_sentinel": fz.sentinel_hits,
        "keys_leaked": len(leaked), "dbsize_before": size_before, "dbsize_after": size_after,
        "rss_mb": {str(k): round(v, 1) for k, v in sorted(fz.rss_mb.items())},
        "health_serving": {str(k): v for k, v in sorted(fz.health.items())},
        "store_alive": fuzz_store.proc.poll() is None}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    assert fz.done == TOTAL and report["malformed"] >= 10_000
    assert report["store_alive"] and all(fz.health.values()) and len(fz.health) == 3
    assert fz.wrong == [], fz.wrong[:10]
    assert leaked == [] and size_after == size_before, leaked[:10]
    # Bounded memory: growth from 6k to 10k requests is small next to the 2k level.
    assert fz.rss_mb[10_000] - fz.rss_mb[6_000] < max(32.0, 0.2 * fz.rss_mb[2_000]), fz.rss_mb


def _append_over_transport_cap(store: StoreProcess, bases: list, declare_count: bool) -> set:
    """Append streams whose second message is over gRPC's receive cap (their message count
    declared as StoreClient declares it, or not); the Redis keys they left behind."""
    keys_before, _ = _keys(store.redis_url)
    rng = np.random.default_rng(7)
    opts = [("grpc.max_send_message_length", 1 << 30)]
    with grpc.insecure_channel(store.address, options=opts) as ch:
        for base in bases:
            case = oversize_append(rng, [base], size=TRANSPORT_CAP + 1024)
            meta = ((APPEND_MESSAGES_KEY, str(len(case.payload))),) if declare_count else ()
            with pytest.raises(grpc.RpcError) as err:
                ch.stream_unary(SERVICE + "Append")(iter(case.payload), timeout=30,
                                                    metadata=meta)
            assert err.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        grpc.StatusCode.CANCELLED), err.value
    return _keys(store.redis_url)[0] - keys_before


def test_message_over_transport_cap_commits_nothing(fuzz_store: StoreProcess) -> None:
    """With the message count declared, as StoreClient declares it (wire_metadata): the store
    sees the stream was cut short and commits none of it, whenever gRPC reports the cut."""
    leaked = _append_over_transport_cap(fuzz_store, base_streams(40)[32:36], declare_count=True)
    assert leaked == set(), sorted(leaked)


def test_declared_count_that_is_not_a_number_is_refused_naming_the_key(
        fuzz_store: StoreProcess) -> None:
    keys_before, _ = _keys(fuzz_store.redis_url)
    msgs = [q.SerializeToString() for q in base_streams(40)[36]]
    with grpc.insecure_channel(fuzz_store.address) as ch:
        for bad in ("two", "-1"):
            with pytest.raises(grpc.RpcError) as err:
                ch.stream_unary(SERVICE + "Append")(
                    iter(msgs), timeout=30, metadata=((APPEND_MESSAGES_KEY, bad),))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert APPEND_MESSAGES_KEY in err.value.details()
        # one message fewer than declared: a stream cut short, nothing committed
        with pytest.raises(grpc.RpcError) as err:
            ch.stream_unary(SERVICE + "Append")(
                iter(msgs), timeout=30, metadata=((APPEND_MESSAGES_KEY, str(len(msgs) + 1)),))
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert "declared" in err.value.details()
    assert _keys(fuzz_store.redis_url)[0] - keys_before == set()


@pytest.mark.xfail(reason="known limit for a client that declares no message count (older "
                   "than wire_metadata.APPEND_MESSAGES_KEY): a message over gRPC's receive cap "
                   "ends the server's request iterator like a clean half-close and the "
                   "cancellation arrives a moment later, so the messages before it may be "
                   "committed (the client sees RESOURCE_EXHAUSTED)", strict=False)
def test_message_over_transport_cap_without_a_declared_count(fuzz_store: StoreProcess) -> None:
    leaked = _append_over_transport_cap(fuzz_store, base_streams(40)[37:40], declare_count=False)
    assert leaked == set(), sorted(leaked)
