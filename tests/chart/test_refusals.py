"""Values that install but cannot work on a cluster are refused at render time (helm template
and install; helm lint only logs a template's `fail`), the message naming the value to change;
the working forms render."""

from __future__ import annotations

import pytest
import yaml
from conftest import API_VERSIONS, CHART, find, run_helm

DOWNLOAD = "model:\n  existingClaim: ''\n  download:\n    uri: hf://Qwen/Qwen3-30B-A3B\n"
LONG = "rollout:\n  config:\n    engine: {max_model_len: 131072}\n"  # 128k trajectories
REFUSED = {
    # name: (values file text, text the error must contain)
    "hostNetwork with NetworkPolicies": ("fastNetwork:\n  hostNetwork: true\n",
                                         "fastNetwork.hostNetwork=true with networkPolicy"),
    "rdma without IPC_LOCK": ("fastNetwork:\n  resources: {rdma/ib: 1}\n",
                              "fastNetwork.ipcLock=true"),
    "download without the dataset": (DOWNLOAD + "rollout:\n  replicas: 1\n",
                                     "model.download.datasetUri"),
    "ReadWriteOnce model PVC for several pods": (
        DOWNLOAD + "    datasetUri: s3://b/datasets\nrollout:\n  replicas: 2\n",
        "model.download.accessMode=ReadWriteOnce"),
    # Redis holds the undelivered backlog and a checkpoint interval of delivered groups
    "Redis too small for backlog + unacked": (
        "store:\n  config:\n    max_unacked_tokens: 80000000\n",
        "max_backlog_tokens (50000000) + max_unacked_tokens (80000000)"),
    # ... and a group of the longest trajectories begun at the budget (issue 54): without it
    # (max_model_len 8192, test_sizing) these values render
    "Redis too small for backlog + unacked + one group of 128k": (
        "store:\n  config:\n    max_unacked_tokens: 61600000\n" + LONG,
        "one group of the longest trajectories (8 x 131072 tokens, 264667104 bytes at the "
        "codec's worst case) = 10308667104 bytes exceeds 80% of redis.maxmemory"),
    "trajectories longer than the store takes": (
        "rollout:\n  config:\n    engine: {max_model_len: 300000}\n    sampling: {n: 2}\n",
        "raise store.config.max_tokens_per_trajectory"),
    "a group over the pull message limit": (
        "store:\n  config:\n    max_pull_message_bytes: 209715200\n" + LONG,
        "over store.config.max_pull_message_bytes 209715200: one Pull could never send it"),
    "store pod too small for a delivered group": (
        "store:\n  resources:\n    limits: {memory: 1Gi}\n" + LONG,
        "store.resources.limits.memory (1Gi = 1073741824 bytes) is below"),
    "rollout pod too small for its longest trajectory": (
        "rollout:\n  resources:\n    limits: {memory: 256Mi}\n",
        "raise rollout.resources.limits.memory"),
    "trainer pod too small for its ranks' groups": (
        "trainer:\n  enabled: true\n  workers:\n    resources:\n      limits: {memory: 2Gi}\n",
        "8 rank(s) x (256 MiB + 3 x a pulled group's"),
    "no registered layout to size for": ("store:\n  models: []\n", "store.models: empty"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_misconfiguration_is_refused_naming_the_value(helm, tmp_path, case):
    text, needle = REFUSED[case]
    values = tmp_path / "bad.yaml"
    values.write_text(text)
    proc = run_helm(helm, "template", "x", str(CHART), *API_VERSIONS, "-f", str(values))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"{case}: helm template accepted it:\n{output[-2000:]}"
    assert needle in output, f"{case}: error does not name {needle!r}:\n{output[-2000:]}"


def _render(helm, tmp_path, text: str) -> list[dict]:
    values = tmp_path / "v.yaml"
    values.write_text(text)
    proc = run_helm(helm, "template", "r3flow", str(CHART), *API_VERSIONS, "-f", str(values))
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def test_the_working_forms_render(helm, tmp_path):
    docs = _render(helm, tmp_path, "fastNetwork:\n  resources: {rdma/ib: 1}\n  ipcLock: true\n"
                   "  hostNetwork: true\nnetworkPolicy:\n  enabled: false\n")
    sts = find(docs, "StatefulSet", "-rollout")[0]["spec"]["template"]["spec"]
    assert sts["hostNetwork"] is True
    assert sts["containers"][0]["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    docs = _render(helm, tmp_path, DOWNLOAD + "    datasetUri: hf://datasets/org/prompts\n"
                   "rollout:\n  replicas: 1\n")
    pvc = find(docs, "PersistentVolumeClaim", "-model")[0]
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    inits = find(docs, "StatefulSet", "-rollout")[0]["spec"]["template"]["spec"]["initContainers"]
    fetches = {c["name"]: c["args"] for c in inits}
    assert fetches["dataset-fetch"][-3:] == ["hf://datasets/org/prompts", "--out",
                                             "/models/datasets"]


def test_checkpoints_are_a_pvc_by_default_and_the_pdb_follows_the_trainer(helm, tmp_path):
    docs = _render(helm, tmp_path, "trainer:\n  enabled: false\n")
    pvc = find(docs, "PersistentVolumeClaim", "-checkpoints")
    assert [p["metadata"]["name"] for p in pvc] == ["r3flow-checkpoints"], \
        "named runs mount r3flow-checkpoints: the release makes it"
    # named runs carry the trainer's labels: the PDB exists without the chart's own trainer
    assert find(docs, "PodDisruptionBudget", "-trainer")
    assert not find(_render(helm, tmp_path, "trainer:\n  enabled: false\n  pdb:\n    enabled: "
                            "false\n"), "PodDisruptionBudget", "-trainer")
    docs = _render(helm, tmp_path, "trainer:\n  enabled: true\n"
                   "plan:\n  expect: does-not-fit\n  expectReason: a render test\n")
    assert find(docs, "PodDisruptionBudget", "-trainer")
    job = find(docs, "RayJob")[0]["spec"]["rayClusterSpec"]
    for tmpl in [job["headGroupSpec"]["template"], job["workerGroupSpecs"][0]["template"]]:
        ckpt = next(v for v in tmpl["spec"]["volumes"] if v["name"] == "checkpoints")
        assert ckpt["persistentVolumeClaim"]["claimName"] == "r3flow-checkpoints"


def test_rollout_pods_shard_the_prompts_and_never_run_out(helm, tmp_path):
    docs = _render(helm, tmp_path, "rollout:\n  replicas: 3\n")
    cfg = yaml.safe_load(find(docs, "ConfigMap", "-rollout")[0]["data"]["rollout.yaml"])
    assert cfg["num_shards"] == 3 and cfg["epochs"] == 0 and cfg["shuffle"] is True
    args = find(docs, "StatefulSet", "-rollout")[0]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert args[args.index("--worker-id") + 1] == "$(POD_NAME)"  # <release>-rollout-<ordinal>
