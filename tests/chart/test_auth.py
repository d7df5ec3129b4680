"""Access control in the chart (production values: mutual TLS + role tokens): the configs name
the mounted files, each client mounts only its own token and only the store's CA, the store
mounts the server key; the defaults render no auth at all (local/insecure, said at start-up)."""

from __future__ import annotations

import yaml
from conftest import find


def _config(docs: list[dict], suffix: str, key: str) -> dict:
    return yaml.safe_load(find(docs, "ConfigMap", suffix)[0]["data"][key])


def _volumes(pod_spec: dict) -> dict[str, dict]:
    return {v["name"]: v for v in pod_spec.get("volumes", [])}


def test_production_store_serves_mutual_tls_with_role_tokens(rendered):
    docs = rendered["production"]
    auth = _config(docs, "-store", "store.yaml")["auth"]
    assert auth["require_client_cert"] is True
    assert set(auth["token_files"]) == {"rollout", "trainer"}
    pod = find(docs, "Deployment", "-store")[0]["spec"]["template"]["spec"]
    vols = _volumes(pod)
    assert "items" not in vols["tls"]["secret"]  # the store needs its key and cert
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert {"/var/run/r3flow/tls", "/var/run/r3flow/tokens"} <= mounts
    assert "httpGet" in pod["containers"][0]["readinessProbe"]  # kubelet gRPC probes lack TLS


def test_clients_mount_only_their_own_token_and_the_ca(rendered):
    docs = rendered["production"]
    rollout_cfg = _config(docs, "-rollout", "rollout.yaml")["store_auth"]
    train_cfg = _config(docs, "-trainer", "train.yaml")["data"]["store_auth"]
    for cfg in (rollout_cfg, train_cfg):
        assert cfg["token_file"] == "/var/run/r3flow/tokens/token"
        assert cfg["ca_file"].endswith("ca.crt") and cfg["cert_file"] and cfg["key_file"]
    rollout = find(docs, "StatefulSet", "-rollout") or find(docs, "Deployment", "-rollout")
    vols = _volumes(rollout[0]["spec"]["template"]["spec"])
    assert vols["tokens"]["secret"]["items"] == [{"key": "rollout", "path": "token"}]
    assert vols["tls"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]


def test_chart_made_token_secret_has_both_roles(rendered):
    secret = find(rendered["production"], "Secret", "-tokens")[0]
    assert set(secret["data"]) == {"rollout", "trainer"}
    assert secret["data"]["rollout"] != secret["data"]["trainer"]


def test_defaults_render_no_auth(rendered):
    docs = rendered["defaults"]
    assert "auth" not in _config(docs, "-store", "store.yaml")
    assert "store_auth" not in _config(docs, "-rollout", "rollout.yaml")
    assert not find(docs, "Secret", "-tokens")
