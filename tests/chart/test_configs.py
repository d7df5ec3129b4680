"""Config files rendered by the chart and shipped in k8s/ load with the components' own typed
configs (extra keys are errors there), so a typo inside a config map fails here, not in a pod."""

from __future__ import annotations

import importlib

import pytest
import yaml
from conftest import find

from services.common.config import load_config

# ConfigMap data key -> (module, class) of the typed config that reads it.
CONFIG_CLASSES = {
    "store.yaml": ("services.store.config", "StoreConfig"),
    "rollout.yaml": ("services.rollout.config", "RolloutConfig"),
    "eval.yaml": ("services.rollout.config", "RolloutConfig"),
    "train.yaml": ("trainer.config", "TrainerConfig"),
}


def config_files(docs: list[dict]) -> list[tuple[str, str, str]]:
    """(ConfigMap name, data key, text) of every component config in `docs`."""
    return [(cm["metadata"]["name"], key, text) for cm in find(docs, "ConfigMap")
            for key, text in (cm.get("data") or {}).items() if key in CONFIG_CLASSES]


def check_loads(name: str, key: str, text: str, tmp_path) -> object:
    module_name, cls_name = CONFIG_CLASSES[key]
    cls = getattr(importlib.import_module(module_name), cls_name)
    path = tmp_path / f"{name}-{key}"
    path.write_text(text)
    return load_config(cls, path)


@pytest.mark.parametrize("values", ["defaults", "production", "minimal"])
def test_chart_configs_load(rendered, values, tmp_path):
    files = config_files(rendered[values])
    keys = {key for _, key, _ in files}
    assert "store.yaml" in keys and "rollout.yaml" in keys
    for name, key, text in files:
        cfg = check_loads(name, key, text, tmp_path)
        # In a pod the metrics server must listen beyond loopback or Prometheus cannot scrape it.
        host = getattr(cfg, "metrics_host", None) or cfg.run.metrics_host  # type: ignore[attr-defined]
        assert host == "0.0.0.0", f"{name}/{key}: metrics host {host}"


def test_k8s_configs_load(k8s_specs, tmp_path):
    files = [f for docs in k8s_specs.values() for f in config_files(docs)]
    assert {"train.yaml", "eval.yaml"} <= {key for _, key, _ in files}
    for name, key, text in files:
        check_loads(name, key, text, tmp_path)


def test_store_address_points_at_the_store_service(rendered):
    docs = rendered["production"]
    service = find(docs, "Service", "-store")[0]
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    address = f"{service['metadata']['name']}:{port}"
    rollout = yaml.safe_load(find(docs, "ConfigMap", "-rollout")[0]["data"]["rollout.yaml"])
    train = yaml.safe_load(find(docs, "ConfigMap", "-trainer")[0]["data"]["train.yaml"])
    assert rollout["store"] == address and train["data"]["store"] == address


@pytest.mark.parametrize("values", ["production"])
def test_trainer_metrics_port_matches_the_scraped_port(rendered, values):
    docs = rendered[values]
    train = yaml.safe_load(find(docs, "ConfigMap", "-trainer")[0]["data"]["train.yaml"])
    service = find(docs, "Service", "-trainer-metrics")[0]
    assert train["run"]["metrics_port"] == service["spec"]["ports"][0]["targetPort"]


def _trainer_configs(docs: list[dict], tmp_path) -> list:
    return [check_loads(name, key, text, tmp_path) for name, key, text in config_files(docs)
            if key == "train.yaml"]


def test_every_trainer_bounds_its_checkpoints(rendered, k8s_specs, tmp_path):
    # A checkpoint of the example is ~TBs: an unbounded run fills its volume.
    cfgs = _trainer_configs(rendered["production"], tmp_path)
    cfgs += [c for docs in k8s_specs.values() for c in _trainer_configs(docs, tmp_path)]
    assert len(cfgs) >= 2
    for cfg in cfgs:
        assert cfg.run.keep_checkpoints > 0, cfg.run.run_dir  # type: ignore[attr-defined]


@pytest.mark.parametrize("values", ["defaults", "production", "minimal"])
def test_store_registers_the_model_the_release_serves(rendered, values, tmp_path):
    # Without registered models the store accepts routing of any layout: a rollout pod on the
    # wrong model would fill the backlog with routing the trainer then refuses.
    from conftest import CHART, VALUES_FILES

    from trainer.plan.layout import Arch
    from trainer.plan.models import load_model_config

    plan_model = yaml.safe_load((CHART / "values.yaml").read_text())["plan"]["model"]
    if VALUES_FILES[values]:
        override = yaml.safe_load(VALUES_FILES[values].read_text()) or {}
        plan_model = override.get("plan", {}).get("model", plan_model)
    # the architecture this release is planned for, as its family reads config.json
    arch = Arch.from_hf_config(load_model_config(plan_model))
    (store,) = [check_loads(n, k, t, tmp_path) for n, k, t in config_files(rendered[values])
                if k == "store.yaml"]
    layouts = {(m.num_experts, m.top_k) for m in store.models}  # type: ignore[attr-defined]
    assert (arch.experts, arch.top_k) in layouts


def test_store_models_value_is_the_only_source(helm, tmp_path):
    from conftest import CHART, run_helm

    bad = tmp_path / "bad.yaml"
    bad.write_text("store:\n  config:\n    models: []\n")
    out = run_helm(helm, "template", "x", str(CHART), "-f", str(bad))
    assert out.returncode != 0 and "set the registered models in store.models" in out.stderr


def test_user_code_configmap_is_mounted_on_the_pythonpath(helm, tmp_path):
    """rollout.userCode.configMap: the rollout pods mount it read-only and import from it."""
    from conftest import CHART, run_helm

    values = tmp_path / "user-code.yaml"
    values.write_text("rollout:\n  userCode:\n    configMap: my-rewards\n")
    out = run_helm(helm, "template", "x", str(CHART), "-f", str(values))
    assert out.returncode == 0, out.stderr
    (sts,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "StatefulSet"
              and d["metadata"]["name"].endswith("rollout")]
    pod = sts["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("configMap", {}).get("name") == "my-rewards"]
    container = pod["containers"][0]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert mount["readOnly"] and env["PYTHONPATH"] == mount["mountPath"] == "/opt/r3flow-user"
    default = run_helm(helm, "template", "x", str(CHART))
    assert "PYTHONPATH" not in default.stdout and "user-code" not in default.stdout
