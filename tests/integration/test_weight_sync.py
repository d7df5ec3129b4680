"""Weight push across real processes (torch.multiprocessing spawn, gloo on 127.0.0.1).

The sender runs in the test process; each receiver is a spawned process that, like a rollout
engine, stays up and takes part in every plan it is handed. Faults are real: a receiver
SIGKILLs or SIGSTOPs itself in the middle of a push (after verifying bucket 1).
"""

from __future__ import annotations

import os
import queue
import signal
import time

import pytest
import torch
import torch.multiprocessing as mp

from services.common.pb.r3flow.v1 import store_pb2
from services.common.weight_sync import (
    WeightReceiver,
    WeightSender,
    WeightSyncAborted,
    WeightSyncConfig,
    WeightSyncError,
)

TIMEOUT_S = 15.0
HEARTBEAT_TIMEOUT_S = 2.0  # well above scheduling hiccups of a busy shared 2-core machine
DETECT_S = HEARTBEAT_TIMEOUT_S + 3.0  # a dead or stalled member is named well before TIMEOUT_S


def _receiver_main(worker_id: str, plans: mp.Queue, results: mp.Queue, ready,
                   fault: tuple[int, str] | None) -> None:
    """A rollout engine's loop: receive each plan; report what it got (or why not)."""
    torch.set_num_threads(1)
    rx = WeightReceiver(worker_id)
    ready.set()
    while (blob := plans.get()) is not None:
        plan = store_pb2.WeightSyncPlan.FromString(blob)

        def on_bucket(k: int, version: int = plan.version) -> None:
            if fault and fault[0] == version and k == 1:
                os.kill(os.getpid(), getattr(signal, fault[1]))

        try:
            got = rx.receive(plan, on_bucket=on_bucket)
            results.put((worker_id, plan.version, "ok", {n: t.clone() for n, t in got.named}))
        except WeightSyncAborted as e:
            results.put((worker_id, plan.version, "aborted", str(e)))
        except WeightSyncError as e:
            results.put((worker_id, plan.version, "error", str(e)))


class Engine:
    """A spawned receiver process and its plan queue."""

    def __init__(self, ctx, worker_id: str, results: mp.Queue,
                 fault: tuple[int, str] | None = None) -> None:
        self.worker_id = worker_id
        self.plans, ready = ctx.Queue(), ctx.Event()
        self.proc = ctx.Process(target=_receiver_main, daemon=True,
                                args=(worker_id, self.plans, results, ready, fault))
        self.proc.start()
        assert ready.wait(timeout=60), f"{worker_id} did not start"

    def info(self) -> store_pb2.WorkerInfo:
        return store_pb2.WorkerInfo(worker_id=self.worker_id, host="127.0.0.1", world_size=1)

    def stop(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(timeout=10)


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    """A small MoE-shaped HF state dict; values depend on the version."""
    g = torch.Generator().manual_seed(version)
    named = [("model.embed_tokens.weight", torch.randn(512, 64, generator=g))]
    for i in range(2):
        p = f"model.layers.{i}"
        named += [(f"{p}.self_attn.qkv_proj.weight", torch.randn(192, 64, generator=g)),
                  (f"{p}.mlp.gate.weight", torch.randn(8, 64, generator=g))]
        named += [(f"{p}.mlp.experts.{e}.down_proj.weight", torch.randn(64, 96, generator=g))
                  for e in range(8)]
    return named + [("model.norm.weight", torch.ones(64)), ("step", torch.tensor([version]))]


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.is_floating_point() else t


def _collect(results: mp.Queue, n: int) -> dict[str, tuple]:
    out = {}
    for _ in range(n):
        worker_id, version, status, payload = results.get(timeout=TIMEOUT_S * 3)
        out[worker_id] = (version, status, payload)
    return out


@pytest.fixture(scope="module")
def ctx():
    return mp.get_context("spawn")


@pytest.fixture
def rig(ctx):
    """A sender with small buckets (so a push has many) and the engines a test starts."""
    cfg = WeightSyncConfig(bucket_bytes=16 << 10, timeout_s=TIMEOUT_S,
                           heartbeat_interval_s=0.1, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    sender, results, engines = WeightSender(cfg), ctx.Queue(), []

    def start(worker_id: str, fault: tuple[int, str] | None = None) -> Engine:
        engines.append(Engine(ctx, worker_id, results, fault))
        return engines[-1]

    yield sender, results, start
    for e in engines:
        e.plans.put(None)
    for e in engines:
        e.stop()
    sender.close()


def _push(sender: WeightSender, version: int, engines: list[Engine]):
    plan = sender.plan(version, [e.info() for e in engines])
    for e in engines:
        e.plans.put(plan.SerializeToString())
    return sender.push(plan, _weights(version))


def _assert_identical(got: dict, version: int, worker_ids: list[str]) -> None:
    for wid in worker_ids:
        v, status, tensors = got[wid]
        assert (v, status) == (version, "ok"), got[wid]
        for name, t in _weights(version):
            assert torch.equal(tensors[name], _wire(t)), (wid, name)


def test_sender_and_two_receivers_get_identical_tensors(rig):
    sender, results, start = rig
    engines = [start("engine-a"), start("engine-b")]
    report = _push(sender, 1, engines)
    assert report.num_buckets > 4 and report.num_tensors == len(_weights(1))
    _assert_identical(_collect(results, 2), 1, ["engine-a", "engine-b"])
    assert not _push(sender, 2, engines).new_group  # same members: group reused
    _assert_identical(_collect(results, 2), 2, ["engine-a", "engine-b"])


def test_killed_receiver_is_named_survivor_discards_then_group_reforms(rig):
    sender, results, start = rig
    a, b = start("engine-a"), start("engine-b", fault=(1, "SIGKILL"))
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as err:
        _push(sender, 1, [a, b])
    elapsed = time.monotonic() - t0
    assert elapsed < DETECT_S, elapsed  # measured here: ~1.05 s with a 1 s heartbeat timeout
    assert err.value.members == ("engine-b (rank 2)",), str(err.value)
    assert "engine-b" in str(err.value)
    version, status, _ = _collect(results, 1)["engine-a"]
    assert (version, status) == (1, "aborted")  # the survivor did not commit
    b.proc.join(timeout=5)
    assert b.proc.exitcode == -signal.SIGKILL

    c = start("engine-c")  # joins between pushes; no sender restart
    assert _push(sender, 2, [a, c]).new_group
    _assert_identical(_collect(results, 2), 2, ["engine-a", "engine-c"])


def test_stalled_receiver_is_named_within_heartbeat_timeout(rig):
    sender, results, start = rig
    a, b = start("engine-a"), start("engine-b", fault=(1, "SIGSTOP"))
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="engine-b") as err:
        _push(sender, 1, [a, b])
    elapsed = time.monotonic() - t0
    b.stop()  # SIGKILL the stopped process
    assert elapsed < DETECT_S, elapsed  # measured here: ~1.06 s with a 1 s heartbeat timeout
    assert err.value.members == ("engine-b (rank 2)",)
    assert _collect(results, 1)["engine-a"][:2] == (1, "aborted")
    try:
        extra = results.get(timeout=0.5)
    except queue.Empty:
        extra = None
    assert extra is None, extra  # engine-b never reported a commit
