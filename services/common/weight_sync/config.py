"""Typed configuration of the weight push (sender side; receivers take theirs from the plan)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.common.config import StrictConfig
from services.common.weight_sync.buckets import default_bucket_bytes


class WeightSyncConfig(StrictConfig):
    """How the trainer pushes weights to the rollout engines."""

    backend: Literal["gloo", "nccl"] = "gloo"
    """gloo for CPU tensors, nccl for CUDA tensors (the same code path)."""
    device: str = "cpu"
    """Where the sender packs buckets: 'cpu' for gloo, 'cuda' / 'cuda:N' for nccl."""
    colocated_ipc: bool = True
    """Push by CUDA IPC handles instead of `backend` when every engine of a plan runs on the
    trainer's own GPU (its registered GPU UUID; `r3flow local` on one GPU): the buckets never
    leave the device (weight_sync.ipc). Said in one log line whenever the choice changes."""
    wire_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of floating tensors on the wire; integer/bool tensors are sent as-is."""
    bucket_bytes: int | None = Field(default=None, gt=0)
    """Bucket size; default 1 GiB for nccl, 64 MiB for gloo (buckets.default_bucket_bytes)."""
    direct_min_bytes: int | None = Field(default=None, gt=0)
    """A tensor at least this big that needs no cast is broadcast in place (default bucket/2)."""
    inflight_buckets: int = Field(default=2, ge=1, le=8)
    """Buckets in flight at once: packing bucket k+1 overlaps the broadcast of bucket k."""
    advertise_addr: str = ""
    """Address receivers use to reach the sender (trainer rank 0): '' = the node/pod IP Ray
    reports for that rank (loopback only for the in-process launcher of `r3flow local`)."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port of the rendezvous store on the sender's node (the chart's weight-sync port on
    Kubernetes, which NetworkPolicies admit); 0 picks a free one (published in each plan)."""
    timeout_s: float = Field(default=120.0, gt=0)
    """Longest wait for any one step of a push (join, a bucket, the acks)."""
    heartbeat_interval_s: float = Field(default=0.25, gt=0)
    """How often each receiver refreshes its heartbeat key."""
    heartbeat_timeout_s: float = Field(default=3.0, gt=0)
    """A member whose heartbeat is older than this is dead or stalled."""
    export_digests_dir: str = ""
    """Test/debug aid, off when '': the sender writes `<dir>/v<version>.json` ({"version",
    "digests": HF name -> `tensor_digest` of the tensor as sent, floating ones in the wire dtype})
    for every push, atomically; compare with the rollout's `weight_digests_file`. Reads every
    byte once more."""

    @model_validator(mode="after")
    def _check(self) -> WeightSyncConfig:
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s: must exceed 2 x heartbeat_interval_s")
        if self.heartbeat_timeout_s >= self.timeout_s:
            raise ValueError("heartbeat_timeout_s: must be below timeout_s")
        if (self.backend == "nccl") != self.device.startswith("cuda"):
            raise ValueError(f"device: {self.device!r} does not fit backend {self.backend!r}")
        return self

    def resolved_bucket_bytes(self) -> int:
        return self.bucket_bytes or default_bucket_bytes(self.backend)

    def resolved_direct_min_bytes(self) -> int:
        return self.direct_min_bytes or self.resolved_bucket_bytes() // 2
