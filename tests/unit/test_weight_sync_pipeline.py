"""The pipelined push: the whole layout announced up front (one key, receivers post every
bucket at once), a layout re-laid out only from the first bucket that changed, the end header
sent while buckets are still in flight, and the stream-ordered (NCCL) host logic run over gloo
on the CPU (the same code; only the waits differ)."""

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
from services.common.weight_sync import push as push_mod
from services.common.weight_sync import receiver as receiver_mod
from services.common.weight_sync import sums as hs


def _weights(seed: int, experts: int = 6) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    named = [(f"model.layers.{i}.mlp.experts.{e}.down_proj.weight",
              torch.randn(24, 16, generator=g)) for i in range(2) for e in range(experts)]
    return named + [("lm_head.weight", torch.randn(200, 64, generator=g)),
                    ("step", torch.tensor([seed], dtype=torch.int64))]


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.is_floating_point() else t


@pytest.fixture
def sender():
    s = WeightSender(WeightSyncConfig(bucket_bytes=1 << 11, timeout_s=10,
                                      heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0))
    yield s
    s.close()


def _push(sender: WeightSender, version: int, named, workers=("a", "b"), rxs=None):
    """Push `named` to fresh (or given) receivers on threads; returns (report, results)."""
    rxs = rxs or [WeightReceiver(w) for w in workers]
    plan = sender.plan(version, [store_pb2.WorkerInfo(worker_id=r.worker_id, world_size=1)
                                 for r in rxs])
    results: dict[str, object] = {}

    def run(rx: WeightReceiver) -> None:
        try:
            results[rx.worker_id] = rx.receive(plan)
        except WeightSyncError as e:
            results[rx.worker_id] = e

    threads = [threading.Thread(target=run, args=(rx,)) for rx in rxs]
    for t in threads:
        t.start()
    try:
        report = sender.push(plan, named)
    finally:
        for t in threads:
            t.join(timeout=30)
    return report, results


def _assert_exact(results: dict, named: list[tuple[str, torch.Tensor]]) -> None:
    for wid, got in results.items():
        assert [n for n, _ in got.named] == [n for n, _ in named], wid
        for (name, t), (_, r) in zip(named, got.named, strict=True):
            assert torch.equal(r, _wire(t)), (wid, name)


def test_a_changed_tensor_relays_out_only_the_buckets_from_its_own_on(sender):
    rxs = [WeightReceiver("a"), WeightReceiver("b")]
    first = _weights(1)
    _, results = _push(sender, 1, first, rxs=rxs)
    _assert_exact(results, first)
    before = list(sender._layout.buckets)
    assert len(before) > 4
    # a tensor in the middle gets a new shape: the buckets before it are kept as they were
    changed = _weights(2)
    k = len(changed) // 2
    changed[k] = (changed[k][0], torch.randn(40, 16))
    report, results = _push(sender, 2, changed, rxs=rxs)
    _assert_exact(results, changed)
    after = sender._layout.buckets
    cut = next(i for i, b in enumerate(before) if b.first + len(b.entries) > k)
    assert cut > 0 and all(x is y for x, y in zip(after[:cut], before[:cut], strict=True))
    assert after[cut] is not before[cut]
    assert [b.index for b in after] == list(range(len(after)))
    assert report.num_buckets == len(after) and report.num_tensors == len(changed)
    steps = list(report.phases)
    assert steps == ["joined", "end_header", "drained", "acked", "committed"]
    assert [report.phases[k] for k in steps] == sorted(report.phases.values())
    assert report.phases["committed"] <= report.seconds
    # the same shapes again: every bucket is reused
    again = [(n, t + 1) for n, t in changed]
    _, results = _push(sender, 3, again, rxs=rxs)
    _assert_exact(results, again)
    assert all(x is y for x, y in zip(sender._layout.buckets, after, strict=True))


def test_layout_fits_checks_names_shapes_dtypes_and_count(sender):
    named = _weights(1)
    _, results = _push(sender, 1, named, workers=("a",))
    layout = sender._layout
    b0 = layout.buckets[0]
    assert layout.fits(b0, named)
    renamed = [("other", named[0][1])] + named[1:]
    retyped = [(named[0][0], named[0][1].double())] + named[1:]
    assert not layout.fits(b0, renamed)
    assert not layout.fits(b0, retyped)
    assert not layout.fits(b0, named[:-1])
    assert not layout.fits(b0, [(named[0][0], [1.0])] + named[1:])


def test_non_tensor_in_a_list_is_an_abort_for_receivers(sender):
    """The sender fails while laying out (after `go`, before the `layout` key): receivers
    blocked on that key wake up with an abort; the next push goes through."""
    rxs = [WeightReceiver("a")]
    plan = sender.plan(1, [store_pb2.WorkerInfo(worker_id="a", world_size=1)])
    out: list[object] = []

    def run() -> None:
        try:
            out.append(rxs[0].receive(plan))
        except WeightSyncError as e:
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    with pytest.raises(TypeError):
        sender.push(plan, _weights(1) + [("bad", 3.0)])
    t.join(timeout=30)
    assert len(out) == 1 and isinstance(out[0], WeightSyncAborted)
    _, results = _push(sender, 2, _weights(2), rxs=rxs)
    _assert_exact(results, _weights(2))


@pytest.mark.parametrize("streamed", [False, True])
def test_stream_ordered_host_logic_over_gloo(sender, monkeypatch, streamed):
    """The NCCL host logic (no host wait per bucket, checksums queued behind each receive,
    one polled wait for the last bucket) delivers exact tensors, list or generator input."""
    monkeypatch.setattr(push_mod, "waits_on_host", lambda backend: False)
    monkeypatch.setattr(receiver_mod, "waits_on_host", lambda backend: False)
    rxs = [WeightReceiver("a"), WeightReceiver("b")]
    for version in (1, 2):
        named = _weights(version)
        _, results = _push(sender, version, iter(named) if streamed else named, rxs=rxs)
        _assert_exact(results, named)


def test_checksum_helpers():
    assert hs.split_by([1, 2, 3, 4, 5], [2, 0, 3]) == [[1, 2], [], [3, 4, 5]]
    sums = [torch.tensor([1, -2], dtype=torch.int64), torch.tensor([3], dtype=torch.int64)]
    assert hs.split_sums(sums) == [[1, -2], [3]]
    assert hs.split_sums([]) == []
    e = [[bk.TensorEntry("x", torch.uint8, (8,), 0, 8), bk.TensorEntry("y", torch.uint8, (8,),
                                                                     64, 8)]]
    assert hs.mismatches(e, [[1, 2]], [[1, 2]]) == []
    assert hs.mismatches(e, [[1, 5]], [[1, 2]]) == ["y"]
    assert hs.mismatches(e, [], [[1, 2]]) == ["<1 buckets announced, 0 received>"]


def test_in_place_buckets_between_packed_ones_with_one_pool_slot():
    """bf16 tensors sent in place take no pool slot; the packed buckets around them share the
    single slot (each waits for the previous packed one) and arrive exact."""
    s = WeightSender(WeightSyncConfig(bucket_bytes=1 << 11, inflight_buckets=1, timeout_s=10,
                                      heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0))
    try:
        g = torch.Generator().manual_seed(0)
        named = []
        for i in range(4):
            named += [(f"big.{i}", torch.randn(32, 32, generator=g).to(torch.bfloat16)),
                      (f"small.{i}.a", torch.randn(20, 20, generator=g)),
                      (f"small.{i}.b", torch.randn(20, 20, generator=g))]
        for version in (1, 2):
            report, results = _push(s, version, named)
            _assert_exact(results, named)
        assert sum(b.direct for b in s._layout.buckets) == 4
        assert report.num_buckets == 8  # each pair of small ones packed together
    finally:
        s.close()
