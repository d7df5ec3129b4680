"""Every r3flow command in the rendered chart and in k8s/ parses with the real `r3flow` CLI."""

from __future__ import annotations

import argparse
import importlib
import shlex

import pytest

from services import cli

_TRAINER_POD_CONTAINERS = ("ray-head", "ray-worker")  # KubeRay sets their command (ray start)


def r3flow_parser() -> tuple[argparse.ArgumentParser, set[str]]:
    """The CLI's own parser; while a sibling subcommand module is still missing, the parser of
    the importable ones (built the same way) plus the names of the missing ones."""
    try:
        return cli.build_parser(), set()
    except ModuleNotFoundError:
        pass
    parser = argparse.ArgumentParser(prog="r3flow")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    missing = set()
    for name, (module_name, help_text) in cli.SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            missing.add(name)
            continue
        module.add_arguments(sub.add_parser(name, help=help_text))
    return parser, missing


def pod_specs(doc: dict) -> list[dict]:
    """Every pod spec inside one manifest (workloads, Jobs, Pods, RayJob/RayCluster groups)."""
    kind, spec = doc["kind"], doc.get("spec", {})
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return [spec["template"]["spec"]]
    if kind == "Pod":
        return [spec]
    if kind in ("RayJob", "RayCluster"):
        cluster = spec.get("rayClusterSpec", spec)
        groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
        return [g["template"]["spec"] for g in groups]
    return []


def r3flow_commands(docs: list[dict]) -> list[tuple[str, list[str]]]:
    """(where, argv after `r3flow`) for every r3flow container command and RayJob entrypoint."""
    out = []
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "RayJob":
            argv = shlex.split(doc["spec"]["entrypoint"])
            assert argv[0] == "r3flow", f"{where}: entrypoint is not an r3flow command: {argv}"
            out.append((f"{where} entrypoint", argv[1:]))
        for pod in pod_specs(doc):
            for c in pod.get("initContainers", []) + pod["containers"]:
                argv = list(c.get("command", [])) + list(c.get("args", []))
                if argv[:1] == ["r3flow"]:
                    out.append((f"{where}/{c['name']}", argv[1:]))
                elif "r3flow-" in c["image"] and not _exempt(doc, c):
                    pytest.fail(f"{where}/{c['name']}: r3flow image runs {argv[:2]}, not r3flow")
    return out


def _exempt(doc: dict, container: dict) -> bool:
    is_helm_test = doc["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"
    return is_helm_test or container["name"] in _TRAINER_POD_CONTAINERS


def assert_all_parse(commands: list[tuple[str, list[str]]]) -> set[str]:
    parser, missing = r3flow_parser()
    seen = set()
    for where, argv in commands:
        assert argv and argv[0] not in missing, \
            f"{where}: subcommand {argv[:1]} has no module yet ({sorted(missing)} missing)"
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{where}: `r3flow {shlex.join(argv)}` does not parse (exit {e.code})")
        seen.add(args.command)
    return seen


@pytest.mark.parametrize("values", ["defaults", "production", "minimal"])
def test_chart_commands_parse(rendered, values):
    seen = assert_all_parse(r3flow_commands(rendered[values]))
    expected = {"store", "rollout", "train"} if values == "production" else {"store", "rollout"}
    assert expected <= seen, f"{values}: expected {expected} among rendered commands, got {seen}"


def test_k8s_spec_commands_parse(k8s_specs):
    commands = [c for docs in k8s_specs.values() for c in r3flow_commands(docs)]
    assert {"train", "rollout", "model"} <= assert_all_parse(commands)


def test_bad_command_is_caught():
    """The check itself: an unknown flag does not slip through."""
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        assert_all_parse([("Deployment/x", ["store", "--no-such-flag", "1"])])
