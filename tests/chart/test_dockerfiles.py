"""Static checks of docker/*.Dockerfile (no Docker engine runs here): syntax, COPY sources exist,
the entrypoint is a real `r3flow` command, a non-root USER, pinned base images."""

from __future__ import annotations

import json
import re
import shlex

import pytest
import yaml
from conftest import CHART, ROOT
from test_commands import r3flow_parser

DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT",
                "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK",
                "SHELL"}


def instructions(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        keyword, _, rest = buf.strip().partition(" ")
        out.append((keyword.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{path.name}: dangling line continuation"
    return out


def exec_form(args: str, where: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(x, str) for x in value), where
    return value


@pytest.fixture(params=DOCKERFILES, ids=lambda p: p.name)
def dockerfile(request):
    return request.param, instructions(request.param)


def test_there_are_three_images():
    assert {p.name for p in DOCKERFILES} == {
        "store.Dockerfile", "rollout.Dockerfile", "trainer.Dockerfile"}


def test_syntax(dockerfile):
    path, ins = dockerfile
    assert ins[0][0] == "FROM", f"{path.name}: first instruction is {ins[0][0]}"
    for keyword, args in ins:
        assert keyword in INSTRUCTIONS, f"{path.name}: unknown instruction {keyword}"
        assert args, f"{path.name}: {keyword} without arguments"
        if keyword in ("ENTRYPOINT", "CMD"):
            exec_form(args, f"{path.name}: {keyword} must be exec (JSON) form")


def test_copy_sources_exist(dockerfile):
    path, ins = dockerfile
    copies = [shlex.split(a) for k, a in ins if k in ("COPY", "ADD")]
    assert copies
    for words in copies:
        if any(w.startswith("--from=") for w in words):
            continue
        sources = [w for w in words if not w.startswith("--")][:-1]
        for src in sources:
            assert (ROOT / src).exists(), f"{path.name}: COPY source {src} not in the repository"


def test_entrypoint_is_a_real_r3flow_command(dockerfile):
    path, ins = dockerfile
    entry = [exec_form(a, path.name) for k, a in ins if k == "ENTRYPOINT"][-1]
    cmd = [exec_form(a, path.name) for k, a in ins if k == "CMD"][-1]
    assert entry == ["r3flow"], f"{path.name}: ENTRYPOINT {entry}"
    parser, missing = r3flow_parser()
    assert cmd[0] not in missing, f"{path.name}: `r3flow {cmd[0]}` has no module yet"
    try:
        args = parser.parse_args(cmd)
    except SystemExit:
        pytest.fail(f"{path.name}: `r3flow {shlex.join(cmd)}` does not parse")
    assert path.name.startswith({"train": "trainer"}.get(args.command, args.command))


def test_runs_as_the_charts_non_root_user(dockerfile):
    path, ins = dockerfile
    users = [a for k, a in ins if k == "USER"]
    assert users, f"{path.name}: no USER (would run as root)"
    uid = users[-1].split(":")[0]
    assert uid not in ("root", "0"), f"{path.name}: USER {users[-1]}"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert int(uid) == values["podSecurityContext"]["runAsUser"]


def test_base_images_are_pinned(dockerfile):
    path, ins = dockerfile
    for _, args in [(k, a) for k, a in ins if k == "FROM"]:
        image = [w for w in args.split() if not w.startswith("--")][0]
        if "@sha256:" in image:
            continue
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag, f"{path.name}: FROM {image} has no tag"
        assert tag != "latest" and re.search(r"\d", tag), f"{path.name}: FROM {image} not pinned"


def test_chart_images_have_dockerfiles():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for component in ("store", "rollout", "trainer"):
        assert values[component]["image"]["repository"] == f"r3flow-{component}"
        assert (ROOT / "docker" / f"{component}.Dockerfile").exists()


def test_trainer_and_rollout_share_one_torch_nccl_build():
    """The weight push's two ends: one base image, so one torch and one NCCL (engines refuse a
    push from another NCCL version)."""
    def final_base(name: str) -> str:
        return [a for k, a in instructions(ROOT / "docker" / name) if k == "FROM"][-1].split()[0]

    assert final_base("trainer.Dockerfile") == final_base("rollout.Dockerfile")
    trainer_reqs = (ROOT / "docker" / "requirements-trainer.txt").read_text()
    assert not re.search(r"^(torch|nvidia-nccl)", trainer_reqs, re.M)  # the base's, never re-pinned
