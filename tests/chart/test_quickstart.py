"""A quickstart that starts (issue 42): every Secret, PersistentVolumeClaim and ConfigMap a pod
of the release mounts or reads (volumes, env, envFrom, imagePullSecrets, a RayJob's authOptions)
is either made by the chart or listed in NOTES.txt with the command that makes it; so is every
one a named run (k8s/*.yaml) mounts, against the release the specs assume (`r3flow`,
production values). docs/operations.md's quickstart lists the named run's too. A name nobody makes
leaves its pods in ContainerCreating."""

from __future__ import annotations

import re

import pytest
import yaml
from conftest import API_VERSIONS, CHART, ROOT, VALUES_FILES, render_notes, run_helm

KINDS = ("Secret", "PersistentVolumeClaim", "ConfigMap")


def _pod_specs(doc: dict) -> list[dict]:
    """Every pod spec inside a workload / RayJob document."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            if "containers" in node and isinstance(node["containers"], list):
                found.append(node)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(doc.get("spec", {}))
    return found


def references(docs: list[dict]) -> set[tuple[str, str]]:
    """(kind, name) of every Secret / PVC / ConfigMap the documents' pods use."""
    refs: set[tuple[str, str]] = set()
    for doc in docs:
        if doc["kind"] == "RayJob":
            auth = doc["spec"].get("rayClusterSpec", {}).get("authOptions") or {}
            if auth.get("secretName"):
                refs.add(("Secret", auth["secretName"]))
        for pod in _pod_specs(doc):
            for v in pod.get("volumes", []):
                if "secret" in v:
                    refs.add(("Secret", v["secret"]["secretName"]))
                if "persistentVolumeClaim" in v:
                    refs.add(("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]))
                if "configMap" in v:
                    refs.add(("ConfigMap", v["configMap"]["name"]))
                for src in (v.get("projected") or {}).get("sources", []):
                    for kind, key in (("Secret", "secret"), ("ConfigMap", "configMap")):
                        if key in src:
                            refs.add((kind, src[key]["name"]))
            for s in pod.get("imagePullSecrets", []):
                refs.add(("Secret", s["name"]))
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                for e in c.get("env", []):
                    ref = (e.get("valueFrom") or {})
                    if "secretKeyRef" in ref:
                        refs.add(("Secret", ref["secretKeyRef"]["name"]))
                    if "configMapKeyRef" in ref:
                        refs.add(("ConfigMap", ref["configMapKeyRef"]["name"]))
                for e in c.get("envFrom", []):
                    if "secretRef" in e:
                        refs.add(("Secret", e["secretRef"]["name"]))
                    if "configMapRef" in e:
                        refs.add(("ConfigMap", e["configMapRef"]["name"]))
        for tpl in (doc.get("spec") or {}).get("volumeClaimTemplates", []):
            # a StatefulSet makes <template>-<pod> claims itself
            refs.discard(("PersistentVolumeClaim", tpl["metadata"]["name"]))
    return refs


def made(docs: list[dict]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] in KINDS}


def listed(notes: str) -> set[tuple[str, str]]:
    """(kind, name) NOTES.txt gives a command for: `kubectl ... create secret TYPE NAME` and the
    PVCs of `kubectl ... create -f -` lines."""
    out = {("Secret", m) for m in re.findall(
        r"^kubectl -n \S+ create secret (?:generic|tls|docker-registry) (\S+)", notes, re.M)}
    for line in notes.splitlines():
        m = re.match(r"^kubectl -n \S+ create -f - <<< '(.*)'$", line)
        if m:
            doc = yaml.safe_load(m.group(1))
            out.add((doc["kind"], doc["metadata"]["name"]))
    return out


def render(helm, values: str | None, notes: bool = False, tmp_path=None):
    extra = ["-f", values] if values else []
    if not notes:
        proc = run_helm(helm, "template", "r3flow", str(CHART), "-n", "r3flow", *API_VERSIONS,
                        *extra)
        assert proc.returncode == 0, proc.stderr
        return [d for d in yaml.safe_load_all(proc.stdout) if d]
    return render_notes(helm, tmp_path, *API_VERSIONS, *extra)


@pytest.mark.parametrize("values", sorted(VALUES_FILES))
def test_every_mount_of_a_render_is_made_or_listed(helm, tmp_path, values):
    path = str(VALUES_FILES[values]) if VALUES_FILES[values] else None
    docs = render(helm, path)
    notes = render(helm, path, notes=True, tmp_path=tmp_path)
    missing = references(docs) - made(docs) - listed(notes)
    assert not missing, f"{values}: pods use {sorted(missing)}, neither rendered nor listed " \
                        f"in NOTES.txt"


def test_every_mount_of_a_named_run_is_made_or_listed(helm, tmp_path, k8s_specs):
    """The named runs beside a release `r3flow` with production values (their headers)."""
    path = str(VALUES_FILES["production"])
    docs = render(helm, path)
    notes = render(helm, path, notes=True, tmp_path=tmp_path)
    have = made(docs) | listed(notes)
    readme = (ROOT / "docs" / "operations.md").read_text()
    for name, spec in k8s_specs.items():
        if name.startswith("tiny-"):
            continue  # tiny-*: CPU smoke runs of tests/cluster, their own release
        missing = references(spec) - made(spec) - have
        assert not missing, f"{name}: mounts {sorted(missing)}, neither made by the release " \
                            f"nor listed in its NOTES.txt"
        for kind, ref in references(spec) - made(spec) - made(docs):
            assert ref in readme, f"docs/operations.md's quickstart does not make {kind} {ref} " \
                                  f"({name})"


def test_the_check_catches_an_unlisted_mount(helm, tmp_path):
    docs = render(helm, str(VALUES_FILES["production"]))
    job = next(d for d in docs if d["kind"] == "RayJob")
    job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["volumes"].append(
        {"name": "extra", "secret": {"secretName": "nobody-makes-this"}})
    notes = render(helm, str(VALUES_FILES["production"]), notes=True, tmp_path=tmp_path)
    assert ("Secret", "nobody-makes-this") in references(docs) - made(docs) - listed(notes)
