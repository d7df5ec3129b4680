"""What a training job leaves in the store's Redis between its checkpoints (issue 59), and
whether the store can send it the largest message of its longest trajectories (issue 54).

A trainer acks the groups it trained only at its checkpoint, so up to `run.checkpoint_every` x
`data.groups_per_step` x group size x sequence tokens stay in Redis, delivered and not yet acked.
The store bounds them by `max_unacked_tokens` (the chart sizes Redis for it beside
`max_backlog_tokens`); at that bound the trainer checkpoints early instead of at its cadence.
A job whose checkpoint interval does not fit the bound is refused here, so the cadence a spec
asks for is the one it gets. Inputs, from the same manifest when it has them (a rendered chart),
else from the RayJob's annotations (a k8s/ spec run against a release; a manifest with neither
is not planned, and tests/unit/test_plan_store.py requires them on every k8s/ RayJob):
  r3flow.io/plan-group-size            samples per prompt (the rollouts' sampling.n)
  r3flow.io/plan-store-unacked-tokens  the release's store max_unacked_tokens
StoreClient.pull, the only pull of this repo's trainers, uses PullChunks: a group travels as
PulledPart messages of one head or one routing chunk each, so the largest message is what one
trajectory of the longest (r3flow.io/plan-seq-len tokens) can put in one part at the codec's
worst case for the planned model's routing layout (services/common/routing_size.py
`max_part_bytes`: the prompt's rows stay one chunk); it must fit the store's
`max_pull_message_bytes` (the rendered store.yaml's, else the store's default), or that group
can never be delivered. (A whole group in one message is only `Pull`'s, which no trainer here
calls: not checked.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.errors import UserError
from services.common.routing_size import max_bytes_per_token, max_part_bytes
from services.store.config import StoreConfig
from trainer.config import TrainerConfig
from trainer.plan import k8s
from trainer.plan.layout import Arch
from trainer.plan.manifest import PREFIX, annotated, config_file, group_size, trainer_of
from trainer.plan.models import load_model_config

MiB = 1 << 20


@dataclass(frozen=True)
class StoreCheck:
    """One RayJob's checkpoint interval against its store's bound on un-acked tokens."""

    where: str
    checkpoint_every: int
    groups_per_step: int
    group_size: int
    seq_len: int
    unacked_limit: int | None  # None: unbounded (Redis then holds whatever the interval is)
    arch: Arch  # the routing layout of the planned model
    pull_limit: int  # the store's max_pull_message_bytes: one PulledPart

    @property
    def part_bytes(self) -> int:
        """The largest PulledPart of the longest trajectories (seq_len tokens) at the codec's
        worst case: one chunk of every row and the tokens' other fields (routing_size.py)."""
        a = self.arch
        return max_part_bytes(self.seq_len, a.moe_layers, a.top_k, a.experts)

    @property
    def pull_ok(self) -> bool:
        return self.part_bytes <= self.pull_limit

    @property
    def interval_tokens(self) -> int:
        """Tokens delivered, at most, between two checkpoints (the ack)."""
        return self.checkpoint_every * self.groups_per_step * self.group_size * self.seq_len

    @property
    def unacked_ok(self) -> bool:
        return self.unacked_limit is not None and self.interval_tokens <= self.unacked_limit

    @property
    def ok(self) -> bool:
        return self.unacked_ok and self.pull_ok

    def describe(self, label: str) -> str:
        return f"{label}\n{self._describe_unacked()}\n{self._describe_pull()}"

    def _describe_pull(self) -> str:
        a = self.arch
        per_token = max_bytes_per_token(a.moe_layers, a.top_k, a.experts)
        head = (f"  store: the largest PullChunks message of the longest trajectories (a "
                f"routing chunk, the prompt's up to {self.seq_len} rows, with a segment's "
                f"tokens; {per_token:.1f} B per token at the codec's worst case for "
                f"{a.moe_layers} MoE layers, top-{a.top_k} of {a.experts}) is up to "
                f"{self.part_bytes / MiB:,.1f} MiB; ")
        if self.pull_ok:
            return head + f"max_pull_message_bytes {self.pull_limit / MiB:,.0f} MiB holds it"
        return head + (f"max_pull_message_bytes {self.pull_limit / MiB:,.0f} MiB DOES NOT hold "
                       "it (the group could never be delivered): raise store.config."
                       "max_pull_message_bytes, or lower the trajectory length")

    def _describe_unacked(self) -> str:
        held = (f"  store: a checkpoint interval ({self.checkpoint_every} steps x "
                f"{self.groups_per_step} groups x {self.group_size} x {self.seq_len} tokens) "
                f"leaves up to {self.interval_tokens:,} tokens delivered and not yet acked; ")
        if self.unacked_limit is None:
            return held + ("max_unacked_tokens unset (unbounded): NOT PLANNED, set it and size "
                           "Redis for it")
        if self.unacked_ok:
            return held + f"max_unacked_tokens {self.unacked_limit:,} holds it"
        return held + (f"max_unacked_tokens {self.unacked_limit:,} DOES NOT hold it (the "
                       "trainer would checkpoint early): raise it with redis.maxmemory, or "
                       "lower run.checkpoint_every")


ANNOTATIONS = ("group-size", "store-unacked-tokens")


def check_rayjob(docs: list[dict], cfg: TrainerConfig, ann: dict[str, str],
                 where: str) -> StoreCheck | None:
    """The job's checkpoint interval against the store config in `docs`, else its annotations;
    None for a manifest that has neither (not planned: the k8s/ specs must have them)."""
    store = config_file(docs, "store.yaml")
    if store is None and not any(PREFIX + k in ann for k in ANNOTATIONS):
        return None
    group = group_size(docs, ann, where) or annotated(ann, "group-size", where)
    fields = StoreConfig.model_fields
    if store is not None:
        limit = store.get("max_unacked_tokens", fields["max_unacked_tokens"].default)
    else:
        limit = annotated(ann, "store-unacked-tokens", where)
    pull = (store or {}).get("max_pull_message_bytes", fields["max_pull_message_bytes"].default)
    if PREFIX + "model" not in ann:
        raise UserError(f"{where}: annotation {PREFIX}model is missing")
    arch = Arch.from_hf_config(load_model_config(ann[PREFIX + "model"]))
    return StoreCheck(where, cfg.run.checkpoint_every, cfg.data.groups_per_step, group,
                      annotated(ann, "seq-len", where), None if limit is None else int(limit),
                      arch, int(pull))


def plan_stores(path: str | Path) -> list[StoreCheck]:
    """The store check of every RayJob in a manifest."""
    docs = k8s.read_documents(path)
    out = []
    for d in docs:
        if d["kind"] == "RayJob":
            try:
                job, cfg = trainer_of(docs, d)
            except UserError as e:  # the job names itself; add the file it is in
                raise UserError(f"{path}: {e}", e.hint) from e
            where = f"{path} RayJob/{job.metadata.name}"
            check = check_rayjob(docs, cfg, job.metadata.annotations, where)
            if check is not None:
                out.append(check)
    return out
