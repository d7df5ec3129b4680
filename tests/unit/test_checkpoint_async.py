"""Background checkpoints (run.async_checkpoint): the step boundary takes a host snapshot and a
thread writes it; the checkpoint is published (meta.json, latest) only once it is written, and a
process killed mid-write resumes from the last complete one. The loop acks a save's groups only
when it is published."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch

from services.common.procenv import pythonpath
from tests.support.fake_loop import FakeRanks, FakeStore, loop_config, pulled_group
from trainer.checkpoint import CheckpointManager, DataPosition
from trainer.checkpoint_snapshot import HostSnapshot
from trainer.loop.loop import TrainLoop, step_parts

ROOT = Path(__file__).resolve().parents[2]


def _model():
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    return module, torch.optim.Adam(module.parameters(), lr=0.1)


def _step(module, opt) -> None:
    opt.zero_grad()
    module(torch.ones(2, 4)).sum().backward()
    opt.step()


class _Gate:
    """Pickled inside the optimizer file: tells the test the write is under way (writes to
    `ready`), then holds the writer until `go` has a byte (or is closed)."""

    def __init__(self, ready: int, go: int) -> None:
        self.ready, self.go = ready, go

    def __reduce__(self):
        os.write(self.ready, b"w")
        os.read(self.go, 1)
        return (int, (0,))


class _GatedOptimizer:
    def __init__(self, opt, gate) -> None:
        self.opt, self.gate = opt, gate

    def state_dict(self):
        return {"inner": self.opt.state_dict(), "gate": self.gate}

    def load_state_dict(self, state) -> None:
        self.opt.load_state_dict(state["inner"])


def test_snapshot_is_taken_at_the_boundary_and_published_when_written(tmp_path):
    module, opt = _model()
    ckpt = CheckpointManager(tmp_path, background=True)
    _step(module, opt)
    ckpt.save(module, opt, DataPosition(step=1, policy_version=1))
    assert ckpt.finish(block=True).name == "step_000001"
    ready, go = os.pipe(), os.pipe()
    gated = _GatedOptimizer(opt, _Gate(ready[1], go[0]))
    _step(module, opt)
    at_save = {k: v.clone() for k, v in module.state_dict().items()}
    ckpt.save(module, gated, DataPosition(step=2, policy_version=2))
    os.read(ready[0], 1)  # the writer is inside the optimizer file
    with torch.no_grad():  # training goes on while it writes: the snapshot is unaffected
        for p in module.parameters():
            p.add_(1.0)
    assert ckpt.finish() is None and ckpt.latest().name == "step_000001"
    os.write(go[1], b"g")
    assert ckpt.finish(block=True).name == "step_000002"
    fresh, opt2 = _model()
    assert CheckpointManager(tmp_path).load(fresh, _GatedOptimizer(opt2, None)).step == 2
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, at_save[k]), k


def _trainer(run_dir: str, ready: int, go: int) -> None:
    """The kill test's trainer process: step 1 published, step 2 in the background, then
    blocked (its writer thread inside step 2's optimizer file) until it is killed."""
    module, opt = _model()
    _step(module, opt)
    ckpt = CheckpointManager(Path(run_dir), background=True)
    ckpt.save(module, opt, DataPosition(step=1, policy_version=1))
    ckpt.finish(block=True)
    _step(module, opt)
    ckpt.save(module, _GatedOptimizer(opt, _Gate(ready, go)),
              DataPosition(step=2, policy_version=2))
    threading.Event().wait()


def test_a_kill_mid_write_resumes_from_the_last_complete_checkpoint(tmp_path):
    """A real process, SIGKILLed while its writer thread is inside step 2's optimizer file. A
    fresh interpreter, not a fork: a fork of a process whose torch thread pool is up (an xdist
    worker after other tests) can deadlock in the child's first parallel op."""
    module, opt = _model()
    _step(module, opt)
    step1 = {k: v.clone() for k, v in module.state_dict().items()}
    ready, go = os.pipe(), os.pipe()
    code = ("from tests.unit.test_checkpoint_async import _trainer; "
            f"_trainer({str(tmp_path)!r}, {ready[1]}, {go[0]})")
    child = subprocess.Popen([sys.executable, "-c", code], pass_fds=(ready[1], go[0]), cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": pythonpath(ROOT)})
    os.close(ready[1])  # a child that dies early closes the pipe: the read ends, no hang
    try:
        readable, _, _ = select.select([ready[0]], [], [], 120)
        # step 2's weights are on disk, its optimizer is not
        assert readable and os.read(ready[0], 1) == b"w", f"trainer exited {child.poll()}"
    finally:
        child.kill()
    assert child.wait(60) == -signal.SIGKILL
    assert (tmp_path / "checkpoints" / "step_000002" / "model_rank0.safetensors").is_file()
    resumed, opt2 = _model()
    ckpt = CheckpointManager(tmp_path, keep=1)
    assert ckpt.latest().name == "step_000001"
    assert ckpt.load(resumed, opt2).step == 1
    for k, v in resumed.state_dict().items():
        assert torch.equal(v, step1[k]), k


def test_host_snapshot_reuses_its_buffers():
    snap, t = HostSnapshot(), torch.arange(6.0)
    first = snap.take({"a": [t], "b": 3})
    assert first["b"] == 3 and torch.equal(first["a"][0], t)
    t += 1
    second = snap.take({"a": [t], "b": 3})
    assert second["a"][0] is first["a"][0] and torch.equal(second["a"][0], t)


class _SlowRanks(FakeRanks):
    """Ranks whose background save is published only at the boundary after the save."""

    def __init__(self) -> None:
        super().__init__(1)
        self.in_flight = False

    def call(self, method, per_rank_args):
        out = super().call(method, per_rank_args)
        if method == "save":
            self.in_flight = True
            return out
        if method == "finish_checkpoint":
            block = per_rank_args[0][0]
            done, self.in_flight = block or not self.in_flight, False
            return ["ckpt" if done else None]
        return out


def test_loop_acks_a_background_save_only_once_it_is_published(tmp_path):
    cfg = loop_config(tmp_path)
    cfg.run.async_checkpoint = True
    store = FakeStore([pulled_group(i) for i in range(8)])
    acked_at = []
    loop = TrainLoop(cfg, _SlowRanks(), store)
    loop.record = lambda m: acked_at.append(len(store.acked))  # acks seen after each step
    loop.run(4)
    # step 2 saves (nothing acked yet), step 3's boundary publishes it; the final save waits
    assert acked_at == [0, 0, 1, 1]
    assert store.acked == [["d0", "d1", "d2", "d3"], ["d4", "d5", "d6", "d7"]]


def test_step_parts_line():
    line = step_parts({"batch_wait_seconds": 0.5, "update_seconds": 0.25, "old_pass_seconds": 0.1,
                       "checkpoint_seconds": 0.01, "ref_pass_seconds": None})
    assert line == "wait 0.50 s, old 0.10 s, update 0.25 s, checkpoint 0.01 s"


def test_reserve_pins_ahead_and_old_checkpoints_go_in_the_background(tmp_path):
    module, opt = _model()
    ckpt = CheckpointManager(tmp_path, keep=1, background=True)
    assert not ckpt.reserved
    _step(module, opt)
    ckpt.reserve(module, opt)  # after the first update: the Adam state exists
    assert ckpt.reserved
    ckpt._reserving.join()
    buffers = list(ckpt._snapshot._buffers)
    assert len(buffers) == len(list(module.parameters())) * 4  # weight, 2 moments, step each
    for step in (1, 2, 3):
        _step(module, opt)
        ckpt.save(module, opt, DataPosition(step=step, policy_version=step))
        ckpt.finish(block=True)
    assert all(a is b for a, b in zip(buffers, ckpt._snapshot._buffers, strict=True))
    for t in ckpt._cleanup:
        t.join()
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["latest", "step_000003"]


class _Starved(FakeStore):
    """A store whose room only an ack frees: once steps 1-2 took four groups, it delivers none
    until they are acked (and counts the empty pulls)."""

    empty_pulls = 0

    def pull(self, consumer, max_groups, lease_seconds=0, wait_ms=0, session=""):
        if not self.acked and len(self.ready) <= 4:
            self.empty_pulls += 1
            return []
        return super().pull(consumer, max_groups, lease_seconds, wait_ms, session)


def test_an_idle_loop_publishes_the_background_save_that_frees_the_store(tmp_path):
    cfg = loop_config(tmp_path)
    cfg.run.async_checkpoint = True
    store = _Starved([pulled_group(i) for i in range(8)])
    loop = TrainLoop(cfg, _SlowRanks(), store)
    # without the publish while idle, step 3 would wait for groups forever (stopped at 20 pulls)
    history = loop.run(3, stop=lambda: store.empty_pulls >= 20)
    assert len(history) == 3 and store.empty_pulls == 1
    assert store.acked[0] == ["d0", "d1", "d2", "d3"]


class _Full(FakeStore):
    """Refuses pulls (UnackedFull) while the first four groups are delivered and unacked."""

    refusals = 0

    def pull(self, consumer, max_groups, lease_seconds=0, wait_ms=0, session=""):
        from services.store.errors import UnackedFull

        if not self.acked and len(self.ready) <= 4:
            self.refusals += 1
            raise UnackedFull("pull: store over max_unacked_tokens")
        return super().pull(consumer, max_groups, lease_seconds, wait_ms, session)


def test_a_full_store_waits_for_the_background_save_that_holds_its_acks(tmp_path):
    cfg = loop_config(tmp_path)
    cfg.run.async_checkpoint = True
    store = _Full([pulled_group(i) for i in range(8)])
    ranks = _SlowRanks()
    history = TrainLoop(cfg, ranks, store).run(3, stop=lambda: store.refusals >= 20)
    assert len(history) == 3 and store.refusals == 1  # published at once, no sleep-and-retry
    assert ("finish_checkpoint", [(True,)]) in ranks.calls
    assert store.acked[0] == ["d0", "d1", "d2", "d3"]
