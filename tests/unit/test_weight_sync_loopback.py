"""The whole push protocol in one process: sender on the main thread, receivers on threads,
a real gloo group on 127.0.0.1 (fast; the multi-process faults are in tests/integration)."""

from __future__ import annotations

import threading

import pytest
import torch

from services.common.pb.r3flow.v1 import store_pb2
from services.common.weight_sync import (
    WeightReceiver,
    WeightSender,
    WeightSyncAborted,
    WeightSyncConfig,
    WeightSyncError,
)
from services.common.weight_sync import buckets as bk


def _cfg(**kw) -> WeightSyncConfig:
    # heartbeat timeout well above scheduling hiccups of a busy shared 2-core machine
    base = dict(bucket_bytes=1 << 12, timeout_s=10, heartbeat_interval_s=0.1,
                heartbeat_timeout_s=2.0)
    return WeightSyncConfig(**(base | kw))


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    named = [(f"model.layers.{i}.mlp.experts.{e}.up_proj.weight", torch.randn(24, 16, generator=g))
             for i in range(2) for e in range(4)]
    return named + [("lm_head.weight", torch.randn(200, 64, generator=g)),
                    ("model.rotary.inv_freq", torch.arange(8, dtype=torch.int64))]


def _run_receivers(plan, receivers, on_bucket=None):
    results: dict[str, object] = {}

    def run(rx: WeightReceiver) -> None:
        try:
            results[rx.worker_id] = rx.receive(plan, on_bucket=on_bucket)
        except WeightSyncError as e:
            results[rx.worker_id] = e

    threads = [threading.Thread(target=run, args=(rx,)) for rx in receivers]
    for t in threads:
        t.start()
    return threads, results


def _workers(*ids: str) -> list[store_pb2.WorkerInfo]:
    return [store_pb2.WorkerInfo(worker_id=i, host="127.0.0.1", world_size=1) for i in ids]


@pytest.fixture
def sender():
    s = WeightSender(_cfg())
    yield s
    s.close()


def test_two_receivers_get_identical_tensors_over_two_pushes(sender):
    rxs = [WeightReceiver("a"), WeightReceiver("b")]
    for version in (1, 2):
        named = _weights(version)
        plan = sender.plan(version, _workers("a", "b"))
        threads, results = _run_receivers(plan, rxs)
        report = sender.push(plan, iter(named) if version == 1 else dict(named))
        for t in threads:
            t.join()
        assert report.num_tensors == len(named) and report.num_buckets > 3
        assert report.new_group == (version == 1)  # same members: the group is reused
        for rx in rxs:
            got = results[rx.worker_id].as_dict()
            assert results[rx.worker_id].version == version
            for name, t in named:
                want = t.to(torch.bfloat16) if t.is_floating_point() else t
                assert torch.equal(got[name], want), name


def test_plan_versions_must_increase_and_a_plan_is_pushed_once(sender):
    sender.plan(5, _workers("a"))
    with pytest.raises(ValueError, match="version"):
        sender.plan(5, _workers("a"))
    sender.cfg.timeout_s = 2.5
    plan = sender.plan(6, _workers("ghost"))
    with pytest.raises(WeightSyncError, match="ghost"):
        sender.push(plan, _weights(0))
    with pytest.raises(ValueError, match="pushed already"):
        sender.push(plan, _weights(0))


def test_member_that_never_joins_is_named(sender):
    """Only the member that never joins is named. The push waits its 3 s for the ghost once
    "a" has joined (an event, not a head start: under load "a" once took over 3 s to join and
    was named too)."""
    from datetime import timedelta

    from services.common.weight_sync.group import Keys, push_store

    sender.cfg.timeout_s = 3.0
    plan = sender.plan(1, _workers("a", "ghost"))
    threads, results = _run_receivers(plan, [WeightReceiver("a")])
    push_store(sender._root, 1).wait([Keys.join(1)], timedelta(seconds=120))
    with pytest.raises(WeightSyncError, match="ghost") as err:
        sender.push(plan, _weights(0))
    threads[0].join()
    assert err.value.members == ("ghost (rank 2)",)
    assert isinstance(results["a"], WeightSyncAborted)


def test_failing_tensor_source_aborts_every_receiver(sender):
    def broken():
        yield from _weights(0)[:3]
        raise RuntimeError("gather failed")

    plan = sender.plan(1, _workers("a"))
    threads, results = _run_receivers(plan, [WeightReceiver("a")])
    with pytest.raises(RuntimeError, match="gather failed"):
        sender.push(plan, broken())
    threads[0].join()
    assert isinstance(results["a"], WeightSyncAborted)
    assert "gather failed" in str(results["a"])


@pytest.mark.parametrize("c_core", [True, False], ids=["c-pack", "torch-pack"])
def test_repeated_layout_and_changed_layout_deliver_exact_tensors(sender, monkeypatch, c_core):
    """A list input reuses the last push's layout while names/shapes/dtypes repeat; a change
    (new tensor, new shape) lays the buckets out again. Receivers see exact tensors always,
    with the C pack (CPU) and with the torch pack (GPU's path; views cached per pool slot, a
    one-off buffer for an oversized tensor: lm_head here)."""
    if not c_core:
        monkeypatch.setattr(bk, "_native", lambda: None)
    rx = WeightReceiver("a")
    grown = _weights(3) + [("extra.bias", torch.randn(5))]
    reshaped = [(n, t.reshape(-1)) for n, t in _weights(4)]
    for version, named in enumerate([_weights(1), _weights(2), grown, reshaped], start=1):
        plan = sender.plan(version, _workers("a"))
        threads, results = _run_receivers(plan, [rx])
        sender.push(plan, named)
        threads[0].join()
        got = results["a"]
        assert [n for n, _ in got.named] == [n for n, _ in named]
        for (name, t), (_, r) in zip(named, got.named, strict=True):
            want = t.to(torch.bfloat16) if t.is_floating_point() else t
            assert torch.equal(r, want), (version, name)


def test_layout_is_published_once_per_distinct_layout(sender):
    """Steady-state pushes put a digest reference on the critical path, not the layout; a
    changed layout replaces the stored one."""
    from services.common.weight_sync.group import Keys, push_store

    rx, digests = WeightReceiver("a"), []
    for version, named in enumerate([_weights(1), _weights(2), _weights(3)[1:]], start=1):
        plan = sender.plan(version, _workers("a"))
        threads, results = _run_receivers(plan, [rx])
        sender.push(plan, named)
        threads[0].join()
        assert not isinstance(results["a"], Exception)
        ref = push_store(sender._root, version).get(Keys.LAYOUT).decode()
        assert ref.startswith(Keys.LAYOUT_REF)
        digests.append(ref.removeprefix(Keys.LAYOUT_REF))
    assert digests[0] == digests[1] != digests[2]  # same shapes twice, then one tensor fewer
    assert sender._root.check([Keys.layout_blob(digests[2])])
    assert not sender._root.check([Keys.layout_blob(digests[0])])  # replaced, not piled up


def test_checksum_mismatch_is_named_and_nobody_commits(sender, monkeypatch):
    """A receiver whose bytes do not match the sender's checksums acks `fail`: the sender
    names it, and every receiver discards (b verified fine but does not load either)."""
    from services.common.weight_sync import buckets as bk

    real = bk.checksum_tensor

    def corrupt_on_a(bucket, entries, bounds=None):
        sums = real(bucket, entries, bounds)
        return sums + 1 if threading.current_thread().name == "rx-a" else sums

    monkeypatch.setattr(bk, "checksum_tensor", corrupt_on_a)
    plan = sender.plan(1, _workers("a", "b"))
    results: dict[str, object] = {}

    def run(rx: WeightReceiver) -> None:
        try:
            results[rx.worker_id] = rx.receive(plan)
        except WeightSyncError as e:
            results[rx.worker_id] = e

    threads = [threading.Thread(target=run, args=(WeightReceiver(w),), name=f"rx-{w}")
               for w in ("a", "b")]
    for t in threads:
        t.start()
    with pytest.raises(WeightSyncError, match="checksum mismatch") as err:
        sender.push(plan, _weights(0))
    for t in threads:
        t.join()
    assert err.value.members == ("a (rank 1)",)
    assert isinstance(results["a"], WeightSyncAborted)
    assert isinstance(results["b"], WeightSyncAborted)


def test_gloo_wait_slices_until_a_late_peer_posts():
    """wait_work blocks in short slices (running the health check between them) and returns
    normally when the op ends, even right at the edge of a slice."""
    import time

    import torch.distributed as dist

    from services.common.weight_sync.group import (
        broadcast,
        connect_store,
        make_process_group,
        wait_work,
    )

    root = connect_store("127.0.0.1", 0, 10, server=True)
    stores = [root, connect_store("127.0.0.1", root.port, 10, server=False)]  # one per rank
    pgs: dict[int, object] = {}

    def build(rank: int) -> None:
        pgs[rank] = make_process_group(dist.PrefixStore("t/", stores[rank]), rank, 2, "gloo",
                                       10, "127.0.0.1")

    peer = threading.Thread(target=build, args=(1,))
    peer.start()
    build(0)
    peer.join()

    checks: list[int] = []
    checked_thrice = threading.Event()

    def check() -> None:
        checks.append(1)
        if len(checks) >= 3:
            checked_thrice.set()

    def late_receiver() -> None:  # posts once the sender's wait has run its check 3 times
        checked_thrice.wait(10)
        broadcast(pgs[1], torch.zeros(1000)).wait()

    peer = threading.Thread(target=late_receiver)
    peer.start()
    sent = torch.arange(1000.0)
    wait_work(broadcast(pgs[0], sent), check, time.monotonic() + 10, True)
    peer.join()
    assert checked_thrice.is_set()  # checked in slices while the peer had not posted


def test_unreachable_sender_is_an_abort_not_a_hang():
    """A plan whose sender is gone: the receiver gives up within its connect timeout."""
    plan = store_pb2.WeightSyncPlan(version=1, master_addr="127.0.0.1", master_port=1,
                                    members=_workers("a"), backend="gloo")
    with pytest.raises(WeightSyncAborted, match="unreachable"):
        WeightReceiver("a", connect_timeout_s=1.0).receive(plan)


def test_worker_with_two_engine_ranks_gets_two_group_ranks(sender):
    """A worker registered with world_size=2 (e.g. TP=2) brings two receivers (local ranks 0
    and 1); both get every tensor."""
    plan = sender.plan(1, [store_pb2.WorkerInfo(worker_id="tp", world_size=2),
                           *_workers("a")])
    rxs = [WeightReceiver("tp", 0), WeightReceiver("tp", 1), WeightReceiver("a")]
    results: list[object] = []

    def run(rx: WeightReceiver) -> None:
        results.append(rx.receive(plan))

    threads = [threading.Thread(target=run, args=(rx,)) for rx in rxs]
    for t in threads:
        t.start()
    report = sender.push(plan, _weights(7))
    for t in threads:
        t.join()
    assert report.members == ("tp[0] (rank 1)", "tp[1] (rank 2)", "a (rank 3)")
    assert len(results) == 3
    for got in results:
        assert [n for n, _ in got.named] == [n for n, _ in _weights(7)]
