"""What a training job leaves in the store's Redis between its checkpoints (issue 59).

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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from services.common.config import YAML_LOADER
from services.common.errors import UserError
from services.store.config import StoreConfig
from trainer.config import TrainerConfig
from trainer.plan import k8s
from trainer.plan.manifest import PREFIX, _number, trainer_of


@dataclass(frozen=True)
class StoreCheck:
    """One RayJob's checkpoint interval against its store's bound on un-acked tokens."""

    where: str
    checkpoint_every: int
    groups_per_step: int
    group_size: int
    seq_len: int
    unacked_limit: int | None  # None: unbounded (Redis then holds whatever the interval is)

    @property
    def interval_tokens(self) -> int:
        """Tokens delivered, at most, between two checkpoints (the ack)."""
        return self.checkpoint_every * self.groups_per_step * self.group_size * self.seq_len

    @property
    def ok(self) -> bool:
        return self.unacked_limit is not None and self.interval_tokens <= self.unacked_limit

    def describe(self, label: str) -> str:
        held = (f"{label}\n  store: a checkpoint interval ({self.checkpoint_every} steps x "
                f"{self.groups_per_step} groups x {self.group_size} x {self.seq_len} tokens) "
                f"leaves up to {self.interval_tokens:,} tokens delivered and not yet acked; ")
        if self.unacked_limit is None:
            return held + ("max_unacked_tokens unset (unbounded): NOT PLANNED, set it and size "
                           "Redis for it")
        if self.ok:
            return held + f"max_unacked_tokens {self.unacked_limit:,} holds it"
        return held + (f"max_unacked_tokens {self.unacked_limit:,} DOES NOT hold it (the "
                       "trainer would checkpoint early): raise it with redis.maxmemory, or "
                       "lower run.checkpoint_every")


ANNOTATIONS = ("group-size", "store-unacked-tokens")


def _config(docs: list[dict], key: str) -> dict | None:
    """The first ConfigMap's `key` file (store.yaml, rollout.yaml) in the manifest, parsed."""
    for d in docs:
        if d["kind"] == "ConfigMap" and key in (d.get("data") or {}):
            return yaml.load(d["data"][key], Loader=YAML_LOADER) or {}  # noqa: S506
    return None


def _annotated(ann: dict[str, str], key: str, where: str) -> int:
    if PREFIX + key not in ann:
        raise UserError(f"{where}: annotation {PREFIX}{key} is missing (the manifest renders "
                        "no store / rollout config to read it from)")
    return int(_number(ann, key, int, where))


def check_rayjob(docs: list[dict], cfg: TrainerConfig, ann: dict[str, str],
                 where: str) -> StoreCheck | None:
    """The job's checkpoint interval against the store config in `docs`, else its annotations;
    None for a manifest that has neither (not planned: the k8s/ specs must have them)."""
    rollout, store = _config(docs, "rollout.yaml"), _config(docs, "store.yaml")
    if store is None and not any(PREFIX + k in ann for k in ANNOTATIONS):
        return None
    group = int((rollout.get("sampling") or {}).get("n", 1)) if rollout is not None \
        else _annotated(ann, "group-size", where)
    if store is not None:
        limit = store.get("max_unacked_tokens", StoreConfig.model_fields[
            "max_unacked_tokens"].default)
    else:
        limit = _annotated(ann, "store-unacked-tokens", where)
    return StoreCheck(where, cfg.run.checkpoint_every, cfg.data.groups_per_step, group,
                      _annotated(ann, "seq-len", where), None if limit is None else int(limit))


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
