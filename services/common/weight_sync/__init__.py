"""Weight push trainer -> rollout engines: bucketed, checksummed broadcasts over a dedicated
gloo (CPU) or NCCL (GPU) group, rendezvous through a `WeightSyncPlan`, two-phase commit.

    sender = WeightSender(WeightSyncConfig(...))        # trainer, rank 0
    plan = sender.plan(version, store.list_workers()); store.publish_weight_sync(plan)
    report = sender.push(plan, model.export_hf_state_dict())

    rx = WeightReceiver(worker_id, local_rank, device)  # each rollout engine rank
    got = rx.receive(plan)                              # after commit only
    load_named_tensors(got.named)

See docs/weight_sync.md.
"""

from services.common.weight_sync.group import (
    Member,
    WeightSyncAborted,
    WeightSyncError,
    members_of,
    rank_in,
)
from services.common.weight_sync.receiver import ReceivedWeights, WeightReceiver
from services.common.weight_sync.sender import PushReport, WeightSender


def __getattr__(name: str):
    # Imported on first use: the transport itself needs torch only (the GPU bench machines
    # have no pydantic); the typed config is for the services.
    if name == "WeightSyncConfig":
        from services.common.weight_sync.config import WeightSyncConfig

        return WeightSyncConfig
    raise AttributeError(name)


__all__ = [
    "Member",
    "PushReport",
    "ReceivedWeights",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncAborted",
    "WeightSyncConfig",
    "WeightSyncError",
    "members_of",
    "rank_in",
]
