"""Trainer ranks as Ray actors: one actor per device (a GPU, or on CPU one process with gloo).

The driver (trainer.step.TrainLoop) pulls from the store and scatters whole GRPO groups to the
actors as serialized PulledGroup bytes; each actor is a `RankWorker` whose torch.distributed
world is exactly the actors (RANK/WORLD_SIZE/MASTER_* set before the process group is created).

Where Ray runs (`RayLaunchConfig.address`): inside a RayJob the driver finds `RAY_ADDRESS` and
joins the KubeRay cluster; the rank actors are placed with a placement group (one bundle per rank,
its CPUs/GPUs from the config), MASTER_ADDR is rank 0's node IP as Ray reports it and each
actor's CUDA device is the GPU Ray assigned to it. Without an address (`r3flow local`, tests) a
private Ray starts on loopback, dashboard off, auth disabled.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.common.net import free_port
from services.common.procenv import pythonpath
from trainer.config import TrainerConfig
from trainer.ranks.ray_config import RayLaunchConfig

REPO = Path(__file__).resolve().parents[2]
LOCAL_RAY_IP = "127.0.0.1"  # the private Ray of `r3flow local` only; a cluster never uses it

log = logging.getLogger(__name__)


def resolve_address(cfg: RayLaunchConfig, env: Mapping[str, str] | None = None) -> str | None:
    """The Ray address to join, or None for a private local Ray."""
    if cfg.address == "local":
        return None
    return cfg.address or (os.environ if env is None else env).get("RAY_ADDRESS") or None


def local_rank_of(gpu_ids: list, visible: str | None) -> int:
    """This actor's CUDA device index: the position of the GPU Ray assigned to it among the
    visible devices (Ray narrows CUDA_VISIBLE_DEVICES to it: 0), or its id when all are visible."""
    if not gpu_ids:
        return 0
    gpu = str(gpu_ids[0])
    if visible:
        ids = [v.strip() for v in visible.split(",")]
        if gpu in ids:
            return ids.index(gpu)
    return int(gpu)


class RankActor:
    """Ray actor body: reports its node, sets this rank's distributed env, builds a RankWorker."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.worker: Any = None

    def address(self) -> tuple[str, int]:
        """(this node's IP as Ray reports it, a free port on it): rank 0's is the rendezvous."""
        import ray

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def setup(self, master_addr: str, master_port: int, cfg_json: str) -> str:
        """Create the process group and the RankWorker; returns where this rank runs."""
        import ray

        local_rank = local_rank_of(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size),
                          LOCAL_RANK=str(local_rank), MASTER_ADDR=master_addr,
                          MASTER_PORT=str(master_port))
        from trainer.ranks.worker import RankWorker

        self.worker = RankWorker(cfg_json, rank=self.rank,
                                 node_ip=ray.util.get_node_ip_address())
        return ray.util.get_node_ip_address()

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)


def init_local_ray(num_cpus: int, attempts: int = 3) -> None:
    """Start a private local Ray (loopback, no dashboard, auth off) unless one is running."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address="local", include_dashboard=False, num_cpus=num_cpus,
                     _node_ip_address=LOCAL_RAY_IP, log_to_driver=True,
                     runtime_env={"env_vars": {"PYTHONPATH": pythonpath(REPO),
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


def check_cluster_addresses(cfg: TrainerConfig) -> None:
    """On a shared cluster every address the trainer gives or dials must reach another pod:
    a loopback store, advertise or metrics address would fail (or go unscraped) silently."""
    from services.common.auth import is_loopback

    checks = {"data.store": cfg.data.store.rsplit(":", 1)[0],
              "weight_sync.advertise_addr": cfg.weight_sync.advertise_addr,
              "run.metrics_host": cfg.run.metrics_host}
    bad = [f"{field}={host!r}" for field, host in checks.items()
           if host and is_loopback(f"{host}:0")]
    if bad:
        raise ValueError(f"{', '.join(bad)}: a loopback address on a Ray cluster (other pods "
                         "cannot reach it); give the Service name / pod address, or 0.0.0.0 "
                         "for run.metrics_host")


def join_ray(address: str) -> None:
    """Connect this driver to an existing Ray cluster (a RayJob's, or one given in config)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=True)
    log.info("joined Ray cluster at %s: %s", address, ray.cluster_resources())


def rank_bundles(cfg: RayLaunchConfig, world_size: int, cluster_gpus: float) -> list[dict]:
    """One placement-group bundle per rank."""
    gpus = cfg.gpus_per_rank if cfg.gpus_per_rank is not None else int(cluster_gpus > 0)
    bundle: dict[str, float] = {"CPU": cfg.cpus_per_rank}
    if gpus:
        bundle["GPU"] = gpus
    return [dict(bundle) for _ in range(world_size)]


# How long a rank whose collective failed waits for Ray to report a peer's death (a dead node is
# noticed by the GCS health checks: seconds to tens of seconds).
DEAD_PEER_WAIT_S = 60.0


class RankDiedError(RuntimeError):
    """A rank actor (or its node) died: the world is broken, the trainer must restart."""


class RayRanks:
    """`world_size` RankActors in one placement group; implements trainer.step.Ranks."""

    def __init__(self, cfg: TrainerConfig, world_size: int) -> None:
        import ray

        rc = cfg.ray
        address = resolve_address(rc)
        if address is None:
            init_local_ray(num_cpus=max(2, int(world_size * rc.cpus_per_rank + 0.999)))
        else:
            check_cluster_addresses(cfg)
            join_ray(address)
        self.world_size = world_size
        self.bundles = rank_bundles(rc, world_size, ray.cluster_resources().get("GPU", 0))
        self.pg = self._placement_group(rc)
        self.actors: list[Any] = self._spawn(rc)
        ip, port = ray.get(self.actors[0].address.remote())
        cfg_json = cfg.model_dump_json()
        self.nodes: list[str] = ray.get([a.setup.remote(ip, port, cfg_json) for a in self.actors])
        log.info("%d rank(s) on nodes %s; MASTER_ADDR=%s:%d", world_size, self.nodes, ip, port)

    def _placement_group(self, rc: RayLaunchConfig) -> Any:
        import ray
        from ray.util.placement_group import placement_group

        pg = placement_group(self.bundles, strategy=rc.placement_strategy, name="r3flow-ranks")
        ready, _ = ray.wait([pg.ready()], timeout=rc.placement_timeout_s)
        if not ready:
            ray.util.remove_placement_group(pg)
            raise RuntimeError(
                f"ray.placement_timeout_s: {self.world_size} rank bundles {self.bundles[0]} "
                f"({rc.placement_strategy}) not placed within {rc.placement_timeout_s:.0f}s; "
                f"cluster resources {ray.cluster_resources()}")
        return pg

    def _spawn(self, rc: RayLaunchConfig) -> list[Any]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        b = self.bundles[0]
        actor_cls = ray.remote(RankActor)
        return [actor_cls.options(
            num_cpus=b["CPU"], num_gpus=b.get("GPU", 0), max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=r)).remote(r, self.world_size)
            for r in range(self.world_size)]

    def call(self, method: str, per_rank_args: list[tuple]) -> list:
        import ray

        refs = [a.call.remote(method, *args)
                for a, args in zip(self.actors, per_rank_args, strict=True)]
        # Results are taken as they come: a rank that died fails the call at once, while the
        # survivors may block in a collective with it until their process group times out.
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                raise self._died(refs.index(done[0]), method, e) from e
            except ray.exceptions.RayTaskError as e:
                # A survivor's collective often fails first (its peer's socket reset) while
                # Ray has yet to report the peer's death: name the dead rank when there is one.
                dead = self._dead_rank(refs, pending)
                if dead is None:
                    raise
                raise self._died(dead[0], method, dead[1]) from e
        return ray.get(refs)

    def _died(self, rank: int, method: str, e: BaseException) -> RankDiedError:
        return RankDiedError(
            f"trainer rank {rank} (node {self.nodes[rank]}) died during {method!r} "
            f"({type(e).__name__}); the job stops here and resumes from its last "
            f"checkpoint when submitted again")

    def _dead_rank(self, refs: list, pending: list,
                   timeout_s: float = DEAD_PEER_WAIT_S) -> tuple[int, BaseException] | None:
        """The first of `pending` whose actor died within `timeout_s` (None: none did)."""
        import ray

        done, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                return refs.index(ref), e
            except Exception:  # noqa: BLE001 - another survivor's failure
                continue
        return None

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors = []
        ray.util.remove_placement_group(self.pg)
