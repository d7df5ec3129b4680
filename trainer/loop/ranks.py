"""The trainer ranks as the loop sees them: typed calls over a rank transport.

A transport (`RankTransport`: trainer.ranks.local_ranks.LocalRanks in-process,
trainer.ranks.ray_launch.RayRanks as Ray actors)
calls a named trainer.ranks.worker.RankWorker method on every rank; `Ranks` is the only place that
names those methods (`RankMethod`: a name outside it is a type error; a unit test holds it to
RankWorker's methods), so the loop and the weight push call typed methods and a typo is an
AttributeError or a type error.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Literal, Protocol, get_args

from trainer.checkpoint import DataPosition

# The RankWorker methods the loop and the weight push call on every rank.
RankMethod = Literal["resume", "set_policy_version", "train", "save", "export_hf_dir",
                     "export_hf", "plan_push", "push_weights"]
RANK_METHODS: tuple[str, ...] = get_args(RankMethod)


class RankTransport(Protocol):
    """Calls a RankWorker method on every rank (in-process or Ray actors)."""

    world_size: int

    def call(self, method: str, per_rank_args: list[tuple]) -> list: ...


class Ranks:
    """Every rank of the trainer, one typed method per RankWorker step."""

    def __init__(self, transport: RankTransport) -> None:
        self.transport = transport

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    def _all(self, method: RankMethod, *args: Any) -> list:
        return self._each(method, [args] * self.world_size)

    def _each(self, method: RankMethod, per_rank_args: list[tuple]) -> list:
        return self.transport.call(method, per_rank_args)

    def resume(self) -> dict | None:
        """Every rank loads the latest checkpoint; rank 0's data position (None: none yet)."""
        return self._all("resume")[0]

    def set_policy_version(self, version: int) -> None:
        self._all("set_policy_version", version)

    def train(self, shares: list[list[bytes]], lr_scale: float = 1.0) -> list[dict]:
        """Rank r trains on `shares[r]` (serialized PulledGroups), every rank's updates at lr x
        `lr_scale`; per-rank metrics."""
        return self._each("train", [(s, lr_scale) for s in shares])

    def save(self, pos: DataPosition) -> None:
        self._all("save", asdict(pos))

    def export_hf_dir(self, step: int) -> str | None:
        """Every rank joins the HF export of `step`; the directory rank 0 wrote."""
        return self._all("export_hf_dir", step)[0]

    def export_hf(self) -> dict:
        """Every rank joins; rank 0's HF-named weights."""
        return self._all("export_hf")[0]

    def plan_push(self, version: int, workers: list[bytes]) -> bytes:
        """Rank 0 plans the push of `version` to `workers` (serialized WorkerInfo); the
        serialized WeightSyncPlan."""
        return self._all("plan_push", version, workers)[0]

    def push_weights(self, plan: bytes) -> dict:
        """Every rank joins the export (a collective), rank 0 sends; rank 0's report (ok,
        error, members, address, num_bytes, seconds, gb_s)."""
        return self._all("push_weights", plan)[0]
