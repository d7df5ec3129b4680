"""The named 30B run, k8s/qwen3-30b-a3b-grpo-r3.yaml, at the box's size (issue 32 (b)): only the
fields that size the run are replaced with the tiny CPU run's, everything else runs as written
(labels, submitterPodTemplate, auth, Secrets, volumes and mounts, env, the loss, replay, optimizer
and checkpoint settings, the entrypoint). What is replaced, and why:
- train.yaml `model_dir` (the tiny MoE on the same models claim) and the model's layout (fp32,
  TP=1 without sequence parallel, PP=1, EP=2 over the two ranks; dispatcher, recompute and router
  settings stay);
- `run.world_size` 32 -> 2, `run.steps` 500 -> 5 (the kill must land before attempt 1 ends: at
  idle a step takes ~1-2 s), `run.checkpoint_every` 20 -> 1 (a checkpoint to resume from after
  the kill), `data.groups_per_step` 64 -> 2;
- the weight push over gloo from CPU (`weight_sync.backend`/`device`: nccl/cuda -> gloo/cpu);
- the GPU worker group: 2 pods instead of 4, each `cpu: 1, memory: 4Gi` instead of 8 GPUs,
  160 CPUs and 1600Gi (one rank per pod, as one rank per GPU there).
"""

from __future__ import annotations

import yaml

SPEC = "qwen3-30b-a3b-grpo-r3.yaml"
WORKER_RESOURCES = {"cpu": "1", "memory": "4Gi"}


def tiny(docs: list[dict]) -> list[dict]:
    """The spec's documents with the tiny override applied (in place)."""
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    train = yaml.safe_load(cm["data"]["train.yaml"])
    train["model_dir"] = "/models/tiny-moe"
    train["model"].update(dtype="fp32", tensor_parallel=1, sequence_parallel=False,
                          pipeline_parallel=1, expert_parallel=2)
    train["run"].update(world_size=2, steps=5, checkpoint_every=1)
    train["data"]["groups_per_step"] = 2
    train["weight_sync"].update(backend="gloo", device="cpu")
    cm["data"]["train.yaml"] = yaml.safe_dump(train, sort_keys=False)
    job = next(d for d in docs if d["kind"] == "RayJob")
    groups = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert len(groups) == 1, [g["groupName"] for g in groups]
    g = groups[0]
    g["replicas"] = g["minReplicas"] = g["maxReplicas"] = 2
    for c in g["template"]["spec"]["containers"]:
        assert "nvidia.com/gpu" in c["resources"]["limits"], c["resources"]
        c["resources"] = {"requests": dict(WORKER_RESOURCES), "limits": dict(WORKER_RESOURCES)}
    return docs
