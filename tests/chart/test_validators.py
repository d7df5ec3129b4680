"""The offline validators that chart_check.sh runs catch what they claim to catch."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import CHART, SCHEMAS, find
from crd_validate import load_validators, validate_docs
from dashboard_validate import DashboardSchemas


@pytest.fixture(scope="module")
def crd_validators():
    return load_validators(str(SCHEMAS / "kuberay-v1.7.0"), strict=True)


@pytest.fixture(scope="module")
def dashboard_schemas():
    return DashboardSchemas(SCHEMAS / "grafana-dashboard-v11.6")


def test_rayjobs_are_valid_and_typos_are_not(rendered, k8s_specs, crd_validators):
    jobs = find(rendered["production"], "RayJob") + find(k8s_specs["qwen3-30b-a3b-grpo-r3.yaml"],
                                                       "RayJob")
    assert len(jobs) == 2 and validate_docs(jobs, crd_validators) == []
    bad = copy.deepcopy(jobs[1])
    bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicaz"] = 4
    errors = validate_docs([bad], crd_validators)
    assert errors and "replicaz" in errors[0]
    bad = copy.deepcopy(jobs[1])
    bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0][
        "resources"]["limits"]["cpu"] = [1]
    assert validate_docs([bad], crd_validators)


def test_unknown_custom_kind_is_an_error_when_required(crd_validators):
    doc = {"apiVersion": "ray.io/v2", "kind": "RayJob", "metadata": {"name": "x"}}
    assert validate_docs([doc], crd_validators, require_all=True)
    assert validate_docs([doc], crd_validators) == []


def test_dashboards_valid_and_breakage_caught(dashboard_schemas):
    for path in sorted((CHART / "dashboards").glob("*.json")):
        dash = json.loads(path.read_text())
        assert dashboard_schemas.errors(dash) == [], path.name
    broken = copy.deepcopy(dash)
    broken["panels"][0]["gridPos"]["wide"] = 3
    broken["panels"][1]["targets"][0]["exprr"] = "up"
    broken["panels"][2]["options"]["legend"]["displayMode"] = "huge"
    errors = dashboard_schemas.errors(broken)
    assert len(errors) >= 3, errors
