"""Plans from Kubernetes manifests: a k8s/ RayJob spec or the rendered chart.

A RayJob is planned from the trainer config in the ConfigMap its pods mount at /etc/r3flow, its
worker groups (GPUs x replicas must equal run.world_size) and its `r3flow.io/plan-*`
annotations, which say what the planner cannot read from the cluster:
  r3flow.io/plan-model          architecture: a known name or a config.json path
  r3flow.io/plan-gpu-memory-gib memory of one GPU
  r3flow.io/plan-seq-len        tokens of one trainer sequence (prompt + response)
  r3flow.io/plan-group-size     samples per prompt, when the manifest renders no rollout.yaml
                                (replay keeps the routing of a step's micro-batches; else 1)
  r3flow.io/plan-expect         fits | does-not-fit: the verdict `--check-expected` requires
  r3flow.io/plan-expect-reason  why a job is expected not to fit (required then)
A job without GPUs (CPU smoke runs) is planned against its worker container's memory limit
split over the ranks of one pod.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from services.common.config import YAML_LOADER, build_config
from services.common.errors import UserError, syntax_error
from trainer.config import HFSection, ModelSection, TrainerConfig
from trainer.plan import k8s
from trainer.plan.layout import Arch, GiB, Layout, Plan, Recompute
from trainer.plan.memory import plan
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
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?)([KMGT]i?)?", str(q))
    if not m:
        raise UserError(f"memory quantity {q!r} is not understood")
    return float(m.group(1)) * _UNITS[m.group(2) or ""]


def layout_from_trainer(cfg: TrainerConfig, seq_len: int, cuda: bool = True,
                        family: str | None = None, group_size: int = 1) -> Layout:
    """The Layout a TrainerConfig runs (model.* parallel sizes, optim.use_distributed_optimizer,
    model.recompute_*, and whether the config sets them at all; the hf backend: FSDP2 over
    hf.sharding's shard group; replay.mode and the micro-batches of a step on a rank for
    groups of `group_size`), its `auto`
    fast-path switches decided as the trainer decides them on pods with (`cuda`) or without
    GPUs (TrainerConfig.fast_path)."""
    return replace(_layout(cfg, seq_len, cuda, family), replay=cfg.replay.mode.value,
                   step_groups=cfg.data.groups_per_step, group_size=group_size)


def _layout(cfg: TrainerConfig, seq_len: int, cuda: bool, family: str | None) -> Layout:
    cfg = cfg.fast_path(cuda, family)
    m: ModelSection = cfg.model
    attention, chunked = m.attention, cfg.loss.chunked_logprobs
    assert attention != "auto" and isinstance(chunked, bool), "fast_path decides every auto"
    lay = Layout(
        world=cfg.run.world_size, ep=m.expert_parallel, etp=m.expert_tensor_parallel,
        tp=m.tensor_parallel,
        pp=m.pipeline_parallel, cp=m.context_parallel, dtype=m.dtype,
        distributed_optimizer=cfg.optim.use_distributed_optimizer,
        grad_reduce_in_fp32=True, recompute=_recompute(m),
        recompute_set=m.recompute_set,
        reference=cfg.loss.uses_reference, micro_batch=cfg.data.micro_batch_size, seq_len=seq_len,
        attention=attention, chunked_logprobs=chunked,
        push_bucket_bytes=cfg.weight_sync.resolved_bucket_bytes()
        if cfg.run.push_weights_every else 0,
        push_inflight=cfg.weight_sync.inflight_buckets)
    if cfg.backend != "hf":
        return lay
    hf: HFSection = cfg.hf
    return replace(lay, fsdp=True, tp=1, pp=1, cp=1, ep=1, etp=1, distributed_optimizer=False,
                   fsdp_shard_group=hf.shard_group_size if hf.sharding == "hybrid" else 0,
                   recompute="full" if hf.gradient_checkpointing else "none",
                   attention="sdpa" if hf.attn_implementation == "sdpa" else "unfused")


def _recompute(m: ModelSection) -> Recompute:
    """The planner's recompute model of a ModelConfig: full, moe (only the MoE block is
    recomputed) or none (selective recompute of other modules saves too little to model)."""
    if m.recompute == "full":
        return "full"
    return "moe" if m.recomputes_router else "none"


def _config_map_text(docs: list[dict], job: k8s.RayJob, where: str) -> str:
    head = job.spec.rayClusterSpec.headGroupSpec
    vol = next((v for v in head.template.spec.volumes if v.name == "config"), None)
    cm_name = vol.configMap.name if vol and vol.configMap else None
    for i, d in enumerate(docs):
        if d["kind"] == "ConfigMap":
            cm = k8s.parse(k8s.ConfigMap, d, f"ConfigMap (document {i + 1})")
            if cm.metadata.name == cm_name and "train.yaml" in cm.data:
                return cm.data["train.yaml"]
    raise UserError(f"{where}: no ConfigMap {cm_name!r} with train.yaml in the same file")


def _number(ann: dict[str, str], key: str, kind: type, where: str) -> Any:
    try:
        value = kind(ann[PREFIX + key])
    except ValueError:
        raise UserError(f"{where}: annotation {PREFIX}{key}: {ann[PREFIX + key]!r} is not "
                        f"a{'n integer' if kind is int else ' number'}") from None
    if not 0 < value < float("inf"):
        raise UserError(f"{where}: annotation {PREFIX}{key}: {value} must be > 0")
    return value


def _device_memory(workers: list[k8s.PodGroup], world: int, ann: dict[str, str],
                   where: str) -> float:
    """GiB one rank may use: the annotated GPU memory, or (no GPUs) a share of the pod's limit."""
    gpus = sum(g.replicas * int(c.limit("nvidia.com/gpu") or 0)
               for g in workers for c in g.template.spec.containers)
    if gpus:
        if gpus != world:
            raise UserError(f"{where}: worker groups hold {gpus} GPUs but run.world_size is "
                            f"{world} (one rank per GPU)")
        if PREFIX + "gpu-memory-gib" not in ann:
            raise UserError(f"{where}: annotation {PREFIX}gpu-memory-gib is missing")
        return float(_number(ann, "gpu-memory-gib", float, where))
    pods = sum(g.replicas for g in workers) or 1
    memory = workers[0].template.spec.containers[0].limit("memory") if workers else 0
    if memory is None:
        raise UserError(f"{where}: workerGroupSpecs[0] container 0 sets no resources.limits."
                        "memory (a job without GPUs is planned against it)")
    return quantity_bytes(memory) / -(-world // pods) / GiB


def trainer_of(docs: list[dict], doc: dict) -> tuple[k8s.RayJob, TrainerConfig]:
    """A RayJob document of `docs` and the trainer config its pods mount."""
    job = k8s.parse(k8s.RayJob, doc, f"RayJob/{(doc.get('metadata') or {}).get('name', '?')}")
    where = f"RayJob/{job.metadata.name}"
    text = _config_map_text(docs, job, where)
    try:
        data = yaml.load(text, Loader=YAML_LOADER)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as e:
        raise syntax_error(f"{where}: train.yaml", e) from None
    return job, build_config(TrainerConfig, data, source=f"{where}: train.yaml")


def config_file(docs: list[dict], key: str) -> dict | None:
    """The first ConfigMap's `key` file (store.yaml, rollout.yaml) in the manifest, parsed."""
    for d in docs:
        if d["kind"] == "ConfigMap" and key in (d.get("data") or {}):
            return yaml.load(d["data"][key], Loader=YAML_LOADER) or {}  # noqa: S506
    return None


def annotated(ann: dict[str, str], key: str, where: str) -> int:
    """An integer `r3flow.io/plan-<key>` annotation; UserError naming it when missing."""
    if PREFIX + key not in ann:
        raise UserError(f"{where}: annotation {PREFIX}{key} is missing (the manifest renders "
                        "no store / rollout config to read it from)")
    return int(_number(ann, key, int, where))


def group_size(docs: list[dict], ann: dict[str, str], where: str) -> int | None:
    """Samples per prompt: the rendered rollout config's sampling.n, else the RayJob's
    `plan-group-size` annotation; None when the manifest has neither."""
    rollout = config_file(docs, "rollout.yaml")
    if rollout is not None:
        return int((rollout.get("sampling") or {}).get("n", 1))
    return annotated(ann, "group-size", where) if PREFIX + "group-size" in ann else None


def plan_rayjob(docs: list[dict], doc: dict, overhead_gib: float | None = None) -> JobPlan:
    """Plan one RayJob of `docs` (the documents of its file)."""
    job, cfg = trainer_of(docs, doc)
    where = f"RayJob/{job.metadata.name}"
    ann = job.metadata.annotations
    for key in ("model", "seq-len"):
        if PREFIX + key not in ann:
            raise UserError(f"{where}: annotation {PREFIX}{key} is missing")
    expect = ann.get(PREFIX + "expect")
    if expect not in (None, "fits", "does-not-fit"):
        raise UserError(f"{where}: {PREFIX}expect must be fits or does-not-fit, not {expect!r}")
    reason = ann.get(PREFIX + "expect-reason", "")
    if expect == "does-not-fit" and not reason:
        raise UserError(f"{where}: {PREFIX}expect=does-not-fit needs {PREFIX}expect-reason")
    workers = job.spec.rayClusterSpec.workerGroupSpecs
    on_gpu = any(c.limit("nvidia.com/gpu") is not None
                 for g in workers for c in g.template.spec.containers)
    model_cfg = load_model_config(ann[PREFIX + "model"])
    lay = layout_from_trainer(cfg, int(_number(ann, "seq-len", int, where)), on_gpu,
                              model_cfg.get("model_type"), group_size(docs, ann, where) or 1)
    memory = _device_memory(workers, lay.world, ann, where)
    overhead = overhead_gib if overhead_gib is not None else (4.0 if on_gpu else 1.0)
    arch = Arch.from_hf_config(model_cfg)
    return JobPlan(where, plan(arch, lay, memory, overhead_gib=overhead), expect, reason)


def plan_manifest(path: str | Path, overhead_gib: float | None = None) -> list[JobPlan]:
    """Every RayJob of a (multi-document) manifest file."""
    docs = k8s.read_documents(path)
    try:
        return [plan_rayjob(docs, d, overhead_gib) for d in docs if d["kind"] == "RayJob"]
    except UserError as e:  # the job names itself; add the file it is in
        raise UserError(f"{path}: {e}", e.hint) from e


@dataclass
class RolloutCheck:
    """A rendered rollout StatefulSet against the engine layout the plan picks."""

    where: str
    plan: Any  # trainer.plan.rollout.RolloutPlan
    tp: int  # the engine's tensor_parallel_size as rendered
    gpus: int  # GPUs per pod

    @property
    def ok(self) -> bool:
        return self.plan.fits and self.tp == self.plan.tp == self.gpus

    def describe(self, label: str) -> str:
        verdict = "as planned" if self.ok else (
            f"NOT AS PLANNED: the pod's engine runs TP {self.tp} on {self.gpus} GPU(s); set "
            f"rollout.gpus to {self.plan.tp}" if self.plan.fits else
            f"NOT AS PLANNED: no engine of up to TP {self.plan.tp} holds the weights and the "
            f"batch's KV cache; lower engine.max_num_seqs or engine.max_model_len, or plan "
            f"GPUs with more memory")
        return f"{self.plan.describe(label)}\n  rendered: TP {self.tp}: {verdict}"


def plan_rollouts(path: str | Path) -> list[RolloutCheck]:
    """Every annotated rollout StatefulSet of a manifest (its engine config from the ConfigMap
    with rollout.yaml that its pods mount)."""
    from trainer.plan.rollout import plan_rollout

    docs = k8s.read_documents(path)
    out = []
    for d in docs:
        ann = (d.get("metadata") or {}).get("annotations") or {}
        if d["kind"] != "StatefulSet" or PREFIX + "model" not in ann:
            continue
        where = f"{path} StatefulSet/{d['metadata']['name']}"
        pod = d["spec"]["template"]["spec"]
        names = {v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v}
        cfgs = [yaml.load(c["data"]["rollout.yaml"], Loader=YAML_LOADER)  # noqa: S506
                for c in docs if c["kind"] == "ConfigMap" and c["metadata"]["name"] in names
                and "rollout.yaml" in (c.get("data") or {})]
        if not cfgs:
            raise UserError(f"{where}: no ConfigMap with rollout.yaml among its volumes")
        eng = cfgs[0]["engine"]
        gpus = int(pod["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0))
        arch = Arch.from_hf_config(load_model_config(ann[PREFIX + "model"]))
        plan_ = plan_rollout(arch, float(_number(ann, "gpu-memory-gib", float, where)),
                             float(eng.get("gpu_memory_utilization", 0.85)),
                             int(eng.get("max_model_len", 1024)),
                             int(eng.get("max_num_seqs", 32)),
                             quantization=str(eng.get("quantization", "none")))
        out.append(RolloutCheck(where, plan_, int(eng.get("tensor_parallel_size", 1)), gpus))
    return out
