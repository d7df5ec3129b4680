"""`LocalRanks`: the trainer's single rank in this process (a `RankTransport` of
trainer.loop.ranks; trainer.ranks.ray_launch.RayRanks is the other, as Ray actors)."""

from __future__ import annotations

from trainer.config import TrainerConfig
from trainer.ranks.worker import RankWorker


class LocalRanks:
    """A single in-process rank (a RankTransport)."""

    world_size = 1

    def __init__(self, cfg: TrainerConfig) -> None:
        self.worker = RankWorker(cfg.model_dump_json())

    def call(self, method: str, per_rank_args: list[tuple]) -> list:
        return [getattr(self.worker, method)(*per_rank_args[0])]
