"""Chart-driven smoke test: run the store exactly as the rendered Deployment would, against a
local Redis, and check grpc.health.v1 and /metrics.

What is substituted, and nothing else: the Secret-backed env (the Redis password) by a local
redis-server's password; the ConfigMap mount path by a temp copy of the rendered config (with
metrics_host on loopback); the listen and metrics ports by free ports on 127.0.0.1; `r3flow` by
the venv's console script.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis
import yaml
from conftest import find
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import dashboards as gen
from services.common.net import free_port
from services.store.redis_server import find_redis_executable

PASSWORD = "chart-smoke-password"


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion in command, args and env values."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)),
                  text)


def container_env(container: dict, secrets: dict[str, str]) -> dict[str, str]:
    """The container's env as the kubelet builds it, Secret refs resolved from `secrets`."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[ref["key"]]
    return env


def replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    return argv[: i + 1] + [value] + argv[i + 2:]


@pytest.fixture
def redis_server(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [find_redis_executable(), "--port", str(port), "--bind", "127.0.0.1",
         "--requirepass", PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield port
    proc.terminate()
    proc.wait(timeout=10)


def store_metrics_on_dashboards_and_alerts() -> set[str]:
    exprs = [a.expr for a in gen.ALERTS] + [
        q.expr for p in gen.TRAINING_PANELS + gen.PIPELINE_PANELS for q in p.queries]
    names = {gen.catalog_name(m) for e in exprs for m in gen.metrics_in_expr(e)}
    return {n for n in names if n and n.startswith("r3flow_store_")}


def wait_serving(address: str, proc: subprocess.Popen, timeout_s: float = 60) -> int:
    channel = grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode()[-3000:]  # type: ignore[union-attr]
            pytest.fail(f"store exited with {proc.returncode}:\n{out}")
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return status
        except grpc.RpcError:
            pass
        time.sleep(0.3)
    pytest.fail(f"store at {address} not SERVING within {timeout_s}s")


def test_rendered_store_command_serves_health(rendered, redis_server, tmp_path):
    docs = rendered["defaults"]
    deployment = find(docs, "Deployment", "-store")[0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    config = yaml.safe_load(find(docs, "ConfigMap", "-store")[0]["data"]["store.yaml"])
    config["metrics_host"] = "127.0.0.1"
    (tmp_path / "store.yaml").write_text(yaml.safe_dump(config))

    env = container_env(container, {"redis-password": PASSWORD})
    assert re.fullmatch(rf"redis://:{PASSWORD}@ci-r3flow-redis:6379/0", env["REDIS_URL"])
    env["REDIS_URL"] = env["REDIS_URL"].replace("ci-r3flow-redis:6379", f"127.0.0.1:{redis_server}")
    argv = [expand(a, env) for a in container["command"] + container["args"]]
    assert argv[:2] == ["r3flow", "store"]
    grpc_port, metrics_port = free_port(), free_port()
    argv = replace_flag(argv, "--config", str(tmp_path / "store.yaml"))
    argv = replace_flag(argv, "--listen", f"127.0.0.1:{grpc_port}")
    argv = replace_flag(argv, "--metrics-port", str(metrics_port))
    argv[0] = shutil.which("r3flow", path=str(Path(sys.executable).parent)) or "r3flow"

    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wait_serving(f"127.0.0.1:{grpc_port}", proc)
        base = f"http://127.0.0.1:{metrics_port}"
        assert urllib.request.urlopen(f"{base}/health", timeout=5).status == 200
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
        exported = set(re.findall(r"^# HELP (\S+)", metrics, re.MULTILINE))
        missing = store_metrics_on_dashboards_and_alerts() - exported
        assert not missing, f"dashboards/alerts use store metrics it does not export: {missing}"
        # It really talks to the Redis the chart's URL names (ours), not an embedded one.
        local = redis.Redis(port=redis_server, password=PASSWORD)
        assert local.info("clients")["connected_clients"] >= 2
    finally:
        proc.terminate()
        proc.communicate(timeout=20)
