"""Trainer ranks as Ray actors: one actor per device (a GPU, or on CPU one process with gloo).

The driver (trainer.step.TrainLoop) pulls from the store and scatters whole GRPO groups to the
actors as serialized PulledGroup bytes; each actor is a `RankWorker` whose torch.distributed
world is exactly the actors (RANK/WORLD_SIZE/MASTER_* set before the process group is created).
On a laptop/CI box Ray runs locally, bound to 127.0.0.1, dashboard off, auth disabled.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

from trainer.config import TrainerConfig

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


log = logging.getLogger(__name__)

class RankActor:
    """Ray actor body: sets this rank's distributed env, then builds a RankWorker."""

    def __init__(self, rank: int, world_size: int, master_port: int, cfg_json: str) -> None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
        from trainer.worker import RankWorker

        self.rank = rank
        self.worker = RankWorker(cfg_json)

    def call(self, method: str, *args):
        out = getattr(self.worker, method)(*args)
        # Only rank 0's export is used; the others join the EP gather and return nothing.
        return None if method == "export_hf" and self.rank else out


def init_local_ray(num_cpus: int, attempts: int = 3) -> None:
    """Start a local Ray (127.0.0.1, no dashboard, auth off) unless one is running."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address="local", include_dashboard=False, num_cpus=num_cpus,
                     _node_ip_address="127.0.0.1", log_to_driver=True,
                     runtime_env={"env_vars": {"PYTHONPATH": str(REPO),
                                               "RAY_AUTH_MODE": "disabled",
                                               "OMP_NUM_THREADS": "1"}})
            return
        # GCS start timed out (RuntimeError) or the node did (a bare Exception from
        # ray._private.node): both seen on a loaded 2-core machine.
        except Exception as e:  # noqa: BLE001
            ray.shutdown()
            if attempt == attempts:
                raise
            log.warning("ray.init attempt %d/%d failed (%s); retrying", attempt, attempts, e)


class RayRanks:
    """`world_size` RankActors; implements trainer.step.Ranks."""

    def __init__(self, cfg: TrainerConfig, world_size: int, local: bool = True) -> None:
        import ray
        import torch

        if local:
            init_local_ray(num_cpus=max(2, world_size))
        gpus = 1 if torch.cuda.is_available() else 0
        actor_cls = ray.remote(num_cpus=1, num_gpus=gpus)(RankActor)
        port, cfg_json = _free_port(), cfg.model_dump_json()
        self.world_size = world_size
        self.actors: list[Any] = [actor_cls.remote(r, world_size, port, cfg_json)
                                  for r in range(world_size)]
        ray.get([a.call.remote("policy_version") for a in self.actors])  # all ranks built

    def call(self, method: str, per_rank_args: list[tuple]) -> list:
        import ray

        return ray.get([a.call.remote(method, *args)
                        for a, args in zip(self.actors, per_rank_args, strict=True)])

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors = []
