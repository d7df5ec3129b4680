"""What `r3flow plan` estimates over: the model's sizes (Arch), the job's parallel layout and
training settings (Layout), and the per-rank table it prints (Plan); the estimate itself is
trainer/plan/memory.py."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from services.common import families
from services.common.errors import UserError
from services.common.families import ModelShape

GiB = 1 << 30
Recompute = Literal["none", "moe", "full"]
RECOMPUTES: tuple[Recompute, ...] = ("none", "moe", "full")  # lightest first


class Arch(ModelShape):
    """The sizes the estimate counts: a ModelShape (services/common/families/_shape.py), read by
    the family of config.json's model_type."""

    @classmethod
    def from_hf_config(cls, cfg: dict) -> Arch:
        """The family's reading of HF config.json `cfg` (services.common.families.model_shape);
        UserError, one line, for an unknown model_type or a key the family needs."""
        try:
            shape = families.model_shape(cfg)
        except ValueError as e:
            raise UserError(f"model config: {e}") from None
        return cls(**{f.name: getattr(shape, f.name) for f in fields(shape)})


@dataclass(frozen=True)
class Layout:
    """Parallel layout and training settings of one job."""

    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    dtype: Literal["bf16", "fp32"] = "bf16"
    distributed_optimizer: bool = False
    grad_reduce_in_fp32: bool = True
    recompute: Recompute = "none"
    recompute_set: bool = True  # False: the config leaves it unset (plan() names its pick)
    reference: bool = False
    micro_batch: int = 1
    seq_len: int = 4096
    attention: Literal["unfused", "sdpa"] = "unfused"  # model.attention (issue 30 fast path)
    chunked_logprobs: bool = False  # loss.chunked_logprobs (issue 30 fast path)
    push_bucket_bytes: int = 0  # weight push bucket (0: no push); see push_bytes
    push_inflight: int = 2  # weight_sync.inflight_buckets
    fsdp: bool = False  # the hf backend: FSDP2 instead of megatron's layout
    fsdp_shard_group: int = 0  # hf hybrid sharding: ranks a weight is sharded over (0: world)
    replay: Literal["r3", "r2", "off"] = "r3"  # replay.mode
    step_groups: int = 0  # data.groups_per_step (0: one micro-batch per rank)
    group_size: int = 1  # samples per prompt (the rollouts' sampling.n)

    @property
    def shard(self) -> int:
        """Ranks each FSDP2 weight is sharded over."""
        return self.fsdp_shard_group or self.world

    def check(self, arch: Arch) -> None:
        """UserError naming the field when the layout cannot be built."""
        if self.fsdp and self.world % self.shard:
            raise UserError(f"hf.shard_group_size {self.shard}: does not divide "
                            f"run.world_size (--world) {self.world}")
        if self.world % (self.tp * self.pp * self.cp):
            raise UserError(f"run.world_size (--world) {self.world}: not a multiple of --tp x "
                            f"--pp x --cp = {self.tp * self.pp * self.cp}")
        if self.world % (self.ep * self.etp * self.pp):
            raise UserError(f"run.world_size (--world) {self.world}: not a multiple of --ep x "
                            f"--etp x --pp = {self.ep * self.etp * self.pp}")
        if arch.experts % self.ep:
            raise UserError(f"model.expert_parallel (--ep) {self.ep}: does not divide "
                            f"{arch.experts} experts")
        if arch.num_layers % self.pp:
            raise UserError(f"model.pipeline_parallel (--pp) {self.pp}: does not divide "
                            f"{arch.num_layers} layers")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def microbatches(self) -> int:
        """Micro-batches of one step on a rank: the loop deals a step's groups out to the
        ranks one by one, and a megatron rank runs those of its whole TP x PP group
        (trainer.megatron.engine.model_parallel_samples)."""
        sequences = -(-self.step_groups // self.world) * self.group_size * self.tp * self.pp
        return max(1, -(-sequences // self.micro_batch))

    @property
    def expert_dp(self) -> int:
        return self.world // (self.ep * self.etp * self.pp)


@dataclass
class Plan:
    """Per-rank memory rows in bytes and the verdict."""

    rows: dict[str, float]
    gpu_bytes: float
    dense_params: float
    expert_params: float
    notes: list[str] = field(default_factory=list)
    recompute: str = ""  # the recompute line: as set, or the plan's pick and its estimates

    @property
    def total(self) -> float:
        return sum(self.rows.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_bytes
