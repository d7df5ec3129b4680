"""Plans from Kubernetes manifests: a k8s/ RayJob spec or the rendered chart.

A RayJob is planned from the trainer config in the ConfigMap its pods mount at /etc/r3flow, its
worker groups (GPUs x replicas must equal run.world_size) and its `r3flow.io/plan-*`
annotations, which say what the planner cannot read from the cluster:
  r3flow.io/plan-model          architecture: a known name or a config.json path
  r3flow.io/plan-gpu-memory-gib memory of one GPU
  r3flow.io/plan-seq-len        tokens of one trainer sequence (prompt + response)
  r3flow.io/plan-expect         fits | does-not-fit: the verdict `--check-expected` requires
  r3flow.io/plan-expect-reason  why a job is expected not to fit (required then)
A job without GPUs (CPU smoke runs) is planned against its worker container's memory limit
split over the ranks of one pod.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainer.plan.memory import Arch, GiB, Layout, Plan, Recompute, plan
from trainer.plan.models import load_model_config

PREFIX = "r3flow.io/plan-"
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "K": 10**3, "M": 10**6,
          "G": 10**9, "T": 10**12, "": 1}


@dataclass
class JobPlan:
    """One planned job and the verdict its spec expects."""

    where: str
    plan: Plan
    expect: str | None
    reason: str

    @property
    def as_expected(self) -> bool:
        return self.expect is None or (self.expect == "fits") == self.plan.fits


def quantity_bytes(q: str | int) -> float:
    """Kubernetes quantity ("1800Gi", "4G", 1024) -> bytes."""
    m = re.fullmatch(r"([0-9.]+)([KMGT]i?)?", str(q))
    if not m:
        raise ValueError(f"memory quantity {q!r} is not understood")
    return float(m.group(1)) * _UNITS[m.group(2) or ""]


def layout_from_trainer(cfg: Any, seq_len: int) -> Layout:
    """The Layout a TrainerConfig runs (model.* parallel sizes, optim.use_distributed_optimizer,
    model.recompute_*)."""
    m = cfg.model
    return Layout(
        world=cfg.run.world_size, ep=m.expert_parallel, etp=m.expert_tensor_parallel,
        tp=m.tensor_parallel,
        pp=m.pipeline_parallel, cp=m.context_parallel, dtype=m.dtype,
        distributed_optimizer=cfg.optim.use_distributed_optimizer,
        grad_reduce_in_fp32=True, recompute=_recompute(m),
        reference=cfg.loss.kl_coef > 0, micro_batch=cfg.data.micro_batch_size, seq_len=seq_len)


def _recompute(m: Any) -> Recompute:
    """The planner's recompute model of a ModelConfig: full, moe (only the MoE block is
    recomputed) or none (selective recompute of other modules saves too little to model)."""
    if m.recompute == "full":
        return "full"
    return "moe" if m.recomputes_router else "none"


def _pod_groups(job: dict) -> tuple[dict, list[dict]]:
    cluster = job["spec"]["rayClusterSpec"]
    return cluster["headGroupSpec"], cluster.get("workerGroupSpecs", [])


def _config_map_text(docs: list[dict], head: dict, where: str) -> str:
    vols = {v["name"]: v for v in head["template"]["spec"].get("volumes", [])}
    cm_name = (vols.get("config") or {}).get("configMap", {}).get("name")
    for d in docs:
        if d.get("kind") == "ConfigMap" and d["metadata"]["name"] == cm_name:
            if "train.yaml" in (d.get("data") or {}):
                return str(d["data"]["train.yaml"])
    raise ValueError(f"{where}: no ConfigMap {cm_name!r} with train.yaml in the same file")


def _device_memory(workers: list[dict], world: int, ann: dict, where: str) -> float:
    """GiB one rank may use: the annotated GPU memory, or (no GPUs) a share of the pod's limit."""
    gpus = sum(int(g.get("replicas", 1)) * int(c.get("resources", {}).get("limits", {})
                                               .get("nvidia.com/gpu", 0))
               for g in workers for c in g["template"]["spec"]["containers"])
    if gpus:
        if gpus != world:
            raise ValueError(f"{where}: worker groups hold {gpus} GPUs but run.world_size is "
                             f"{world} (one rank per GPU)")
        if PREFIX + "gpu-memory-gib" not in ann:
            raise ValueError(f"{where}: annotation {PREFIX}gpu-memory-gib is missing")
        return float(ann[PREFIX + "gpu-memory-gib"])
    pods = sum(int(g.get("replicas", 1)) for g in workers) or 1
    limit = quantity_bytes(workers[0]["template"]["spec"]["containers"][0]["resources"]
                           ["limits"]["memory"]) if workers else 0.0
    return limit / -(-world // pods) / GiB


def plan_rayjob(docs: list[dict], job: dict, overhead_gib: float | None = None) -> JobPlan:
    """Plan one RayJob of `docs` (the documents of its file)."""
    from services.common.config import ConfigError
    from trainer.config import TrainerConfig

    where = f"RayJob/{job['metadata']['name']}"
    ann = job["metadata"].get("annotations") or {}
    head, workers = _pod_groups(job)
    try:
        cfg = TrainerConfig.model_validate(yaml.safe_load(_config_map_text(docs, head, where)))
    except ValueError as e:
        raise ConfigError(f"{where}: train.yaml: {e}") from None
    for key in ("model", "seq-len"):
        if PREFIX + key not in ann:
            raise ValueError(f"{where}: annotation {PREFIX}{key} is missing")
    expect = ann.get(PREFIX + "expect")
    if expect not in (None, "fits", "does-not-fit"):
        raise ValueError(f"{where}: {PREFIX}expect must be fits or does-not-fit, not {expect!r}")
    reason = ann.get(PREFIX + "expect-reason", "")
    if expect == "does-not-fit" and not reason:
        raise ValueError(f"{where}: {PREFIX}expect=does-not-fit needs {PREFIX}expect-reason")
    arch = Arch.from_hf_config(load_model_config(ann[PREFIX + "model"]))
    lay = layout_from_trainer(cfg, int(ann[PREFIX + "seq-len"]))
    memory = _device_memory(workers, lay.world, ann, where)
    on_gpu = any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
                 for g in workers for c in g["template"]["spec"]["containers"])
    overhead = overhead_gib if overhead_gib is not None else (4.0 if on_gpu else 1.0)
    return JobPlan(where, plan(arch, lay, memory, overhead_gib=overhead), expect, reason)


def plan_manifest(path: str | Path, overhead_gib: float | None = None) -> list[JobPlan]:
    """Every RayJob of a (multi-document) manifest file."""
    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    return [plan_rayjob(docs, d, overhead_gib) for d in docs if d.get("kind") == "RayJob"]
