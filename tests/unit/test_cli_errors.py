"""A user's mistake is one line and exit 2 on every `r3flow` command; a bug keeps its traceback.

The examples of issue 35 in-process and through the real console script; the shared error path
(services/common/errors.py) on its own. tests/unit/test_cli_fuzz.py fuzzes the same path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

from services import cli
from services.common.config import ConfigError
from services.common.errors import UserError, run_command, syntax_error
from services.common.procenv import pythonpath
from services.store import cli as store_cli
from services.store.client import StoreClient

ROOT = Path(__file__).resolve().parents[2]
BAD_YAML = "trainer:\n  run: [1\n  x: 2\n"
# argv, what the one line must say (the issue's examples)
EXAMPLES = {
    "steps": (["local", "--steps", "-1"], "r3flow local: config: trainer.run.steps: Input "
              "should be greater than or equal to 0"),
    "family": (["local", "--family", "foo"], "r3flow local: config: family: 'foo' is not one of"),
    "local config": (["local", "--config", "/nonexistent.yaml"],
                     "r3flow local: config file not found: '/nonexistent.yaml'"),
    "train config": (["train", "--config", "/nonexistent.yaml"],
                     "r3flow train: config file not found: '/nonexistent.yaml'"),
    "model family": (["model", "tiny-moe", "--out", "m", "--family", "nope"],
                     "r3flow model: --family: 'nope' is not one of qwen3_moe"),
    "yaml syntax": (["local", "--config", "bad.yaml"],
                    "r3flow local: bad.yaml: line 3, column 4: "),
    "not k8s": (["plan", "--manifest", "/etc/hostname"],
                "r3flow plan: /etc/hostname: document 1 is not a Kubernetes object"),
}


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> Path:
    (tmp_path / "bad.yaml").write_text(BAD_YAML)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", EXAMPLES)
def test_issue_examples_are_one_line_exit_2(name, cwd, capsys):
    """Run for real (no --check): each must fail before anything starts or is written."""
    argv, line = EXAMPLES[name]
    if name == "not k8s" and not Path("/etc/hostname").is_file():
        pytest.skip("no /etc/hostname here")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err
    assert sorted(p.name for p in cwd.iterdir()) == ["bad.yaml"]


def test_console_script_end_to_end(cwd):
    """The installed `r3flow` script: exit 2, exactly one line on stderr, nothing on stdout."""
    script = Path(sys.executable).with_name("r3flow")
    if not script.exists():
        pytest.skip(f"no console script at {script}")
    env = {**os.environ, "PYTHONPATH": pythonpath(ROOT)}
    procs = {name: subprocess.Popen([str(script), *argv], cwd=cwd, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, (argv, _) in EXAMPLES.items() if name in ("steps", "yaml syntax",
                                                                  "model family")}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert (proc.returncode, out) == (2, ""), (name, out, err)
        assert err.splitlines() == [EXAMPLES[name][1]] or (
            len(err.splitlines()) == 1 and err.startswith(EXAMPLES[name][1])), (name, err)


def test_debug_log_level_shows_the_traceback_too(cwd, capsys):
    assert cli.main(["local", "--steps", "-1", "--log-level", "debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "ConfigError" in err
    assert err.strip().splitlines()[-1].startswith("r3flow local: config: trainer.run.steps")


def test_argparse_mistakes_are_one_line_and_a_hint(cwd, capsys):
    for argv, line in [(["local", "--steps", "x"], "r3flow local: argument --steps: invalid int"),
                       (["local", "--zz"], "r3flow local: unrecognized arguments: --zz"),
                       (["plan", "--tp", "0"], "r3flow plan: argument --tp: must be > 0"),
                       (["--log-level", "loud", "plan"], "r3flow: argument --log-level:")]:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err.splitlines()
        assert e.value.code == 2 and len(err) == 2 and err[0].startswith(line), err


def test_a_bug_keeps_its_traceback(capsys):
    def bug() -> int:
        raise KeyError("not a user's mistake")

    with pytest.raises(KeyError):
        run_command("local", bug)
    assert capsys.readouterr().err == ""


def test_user_errors_and_named_files_are_one_line(tmp_path, capsys):
    def missing() -> int:
        (tmp_path / "nope.txt").read_text()
        return 0

    named = str(tmp_path / "nope.txt")
    assert run_command("model", missing, inputs=[named]) == 2
    assert capsys.readouterr().err == f"r3flow model: {named}: No such file or directory\n"
    with pytest.raises(FileNotFoundError):  # a file the user did not name: a bug
        run_command("model", missing, inputs=[])

    def config() -> int:
        raise ConfigError("config: a.b: unknown key\nsecond line")

    assert run_command("store", config) == 2
    assert capsys.readouterr().err == "r3flow store: config: a.b: unknown key second line\n"

    def hinted() -> int:
        raise UserError("store at x not SERVING", hint="check --store")

    assert run_command("train", hinted) == 2
    assert capsys.readouterr().err.splitlines() == ["r3flow train: store at x not SERVING",
                                                    "check --store"]


def test_syntax_errors_name_line_and_column():
    with pytest.raises(yaml.YAMLError) as y:
        yaml.safe_load(BAD_YAML)
    assert str(syntax_error("f.yaml", y.value)).startswith("f.yaml: line 3, column 4: ")
    with pytest.raises(json.JSONDecodeError) as j:
        json.loads('{"a": 1,\n "b": }')
    assert str(syntax_error("f.json", j.value)) == ("f.json: line 2, column 7: Expecting value")


def test_unreachable_store_and_redis_at_start_are_user_errors():
    """A wrong --store or redis_url is the user's mistake once the start-up wait runs out."""
    with StoreClient("127.0.0.1:1") as client, pytest.raises(UserError, match="127.0.0.1:1"):
        client.wait_ready(0.2)
    r = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    with pytest.raises(UserError, match=r"redis_url: redis://127.0.0.1:1/0 unreachable"):
        store_cli._wait_for_redis(r, "redis://127.0.0.1:1/0", timeout_s=0.0)
