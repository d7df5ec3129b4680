"""Inputs of the `r3flow` fuzz (tests/unit/test_cli_fuzz.py): valid flags, config files and
manifests, and random mutations of them.

A case is (command, argv, needles): if the command refuses it (exit 2), its one line must name
one of the needles (the flag, the field's key, or the file).
"""

from __future__ import annotations

import copy
import json
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from services.common.tiny_moe import TinyMoeConfig
from services.local.config import LocalConfig
from services.rollout.config import RolloutConfig
from services.store.config import StoreConfig
from trainer.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = [ROOT / "k8s" / "tiny-moe-smoke.yaml", ROOT / "k8s" / "qwen3-30b-a3b-grpo-r3.yaml"]
JUNK_VALUES: list[Any] = [-1, 0, -10**12, 10**30, 1e308, "zz", "", [1, "a"], {"zz": 1}, None,
                          True, 3.5, "-7"]
JUNK_FLAGS = ["-1", "0", "x", "", "1e3", "99999999999999999999999", " 3", "nan", "inf", "-",
              "--", "é", "3.5", "/nonexistent/x.yaml", "a=b", "\t"]
DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
DAMAGE = ":[]{}\"'\t&*!|>%@`#-,\n\\"


@dataclass(frozen=True)
class Case:
    command: str
    argv: list[str]
    needles: tuple[str, ...]
    kind: str


# command -> (config class, its --config flag's argv prefix, its file mapping overrides)
CONFIGS: dict[str, tuple[type, list[str], dict[str, Any]]] = {
    "local": (LocalConfig, ["local"], {}),
    "train": (TrainerConfig, ["train"], {}),
    "store": (StoreConfig, ["store"], {}),
    "rollout": (RolloutConfig, ["rollout"], {"engine": {"model": "m"}, "dataset": "d.jsonl"}),
    "model": (TinyMoeConfig, ["model", "tiny-moe", "--out", "out/model"], {}),
}
# command -> {flag: (needles naming it, kind of value)}
FLAGS: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    "local": {"--steps": (("--steps", "trainer.run.steps"), "int"), "--workers": (("--workers",
              "workers"), "int"), "--seed": (("--seed", "seed"), "int"),
              "--warm-start-steps": (("--warm-start-steps", "warm_start_steps"), "int"),
              "--family": (("--family", "family"), "str"), "--replay": (("--replay",), "str"),
              "--trainer-backend": (("--trainer-backend",), "str"),
              "--runs-dir": (("--runs-dir", "runs_dir"), "str"), "--compare": (("--compare",),
                                                                                "str")},
    "train": {"--steps": (("--steps", "run.steps"), "int"), "--metrics-port": (
              ("--metrics-port", "run.metrics_port"), "int"), "--store": (("--store",
              "data.store"), "str"), "--replay": (("--replay",), "str"), "--backend": (
              ("--backend",), "str"), "--hf-config": (("--hf-config", "hf."), "path"),
              "--run-dir": (("--run-dir", "run.run_dir"), "str")},
    "store": {"--listen": (("--listen", "listen"), "str"), "--metrics-port": (
              ("--metrics-port", "metrics_port"), "int"), "--redis-url": (("--redis-url",
              "redis_url"), "str")},
    "rollout": {"--metrics-port": (("--metrics-port", "metrics_port"), "int"),
                "--stop-grace-s": (("--stop-grace-s",), "float"), "--set": (("--set",), "str"),
                "--store": (("--store", "store"), "str"), "--worker-id": (("--worker-id",
                "worker_id"), "str")},
    "model": {"--family": (("--family",), "str"), "--set": (("--set",), "str"),
              "--out": (("--out",), "path")},
    "plan": {"--seq-len": (("--seq-len",), "int"), "--gpu-memory-gib": (("--gpu-memory-gib",),
             "float"), "--tp": (("--tp",), "int"), "--ep": (("--ep",), "int"),
             "--vllm-share": (("--vllm-share", "vllm_share"), "float"),
             "--overhead-gib": (("--overhead-gib",), "float"), "--recompute": (("--recompute",),
                                                                                "str"),
             "--model": (("--model", "model config"), "path")},
}


def write_inputs(tmp: Path) -> dict[str, Path]:
    """The valid input files, written into `tmp` (before the 'nothing written' snapshot)."""
    files: dict[str, Path] = {}
    for name, (cls, _, extra) in CONFIGS.items():
        data = {**cls.model_validate(extra).model_dump(mode="json"), **extra}
        files[name] = tmp / f"{name}.yaml"
        files[name].write_text(yaml.safe_dump(data))
    (tmp / "dir.yaml").mkdir()
    files["train_plan"] = tmp / "plan-train.yaml"
    files["train_plan"].write_text(yaml.safe_dump({"model_dir": "tiny-moe"}))
    for src in MANIFESTS:
        shutil.copy(src, tmp / src.name)
    (tmp / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    (tmp / "model.json").write_text('{"num_hidden_layers": "many", "hidden_size": 8}')
    return files


def leaf_paths(data: Any, prefix: tuple = ()) -> Iterator[tuple]:
    if isinstance(data, dict) and data:
        for k, v in data.items():
            yield from leaf_paths(v, (*prefix, k))
    elif isinstance(data, list) and data and prefix:
        for i, v in enumerate(data):
            yield from leaf_paths(v, (*prefix, i))
    else:
        yield prefix


def _get(data: Any, path: tuple) -> Any:
    for part in path:
        data = data[part]
    return data


def _set(data: Any, path: tuple, value: Any, drop: bool = False) -> None:
    node = data
    for part in path[:-1]:
        node = node[part]
    if drop:
        del node[path[-1]]
    else:
        node[path[-1]] = value


def mutate_mapping(rng: random.Random, data: dict) -> tuple[Any, tuple[str, ...], str]:
    """A structural mutation: (new data, key parts the refusal should name, kind)."""
    data = copy.deepcopy(data)
    paths = [p for p in leaf_paths(data) if p]
    path = rng.choice(paths)
    names = tuple(str(p) for p in path if not isinstance(p, int))
    kind = rng.choice(["retype"] * 4 + ["drop"] * 2 + ["unknown"] * 2 + ["top"])
    if kind == "retype":
        _set(data, path, rng.choice(JUNK_VALUES))
    elif kind == "drop":
        _set(data, path, None, drop=True)
    elif kind == "unknown":
        sections = [path[:k] for k in range(len(path)) if isinstance(_get(data, path[:k]), dict)]
        _set(data, (*rng.choice(sections), "zz_typo"), 1)
        names = ("zz_typo",)
    else:
        data, names = rng.choice([[data], "just text", 42, None, [1, 2]]), ("top level",)
    return data, names, kind


def damage_text(rng: random.Random, text: str) -> str:
    """Syntax damage: a character inserted or deleted, a cut, a line re-indented."""
    i = rng.randrange(len(text) + 1)
    how = rng.randrange(4)
    if how == 0:
        return text[:i] + rng.choice(DAMAGE) + text[i:]
    if how == 1:
        return text[:i] + text[i + 1:]
    if how == 2:
        return text[:i]
    lines = text.splitlines()
    j = rng.randrange(len(lines))
    lines[j] = " " * rng.randrange(1, 5) + lines[j]
    return "\n".join(lines)


def dump(rng: random.Random, data: Any, path: Path) -> Path:
    """`data` as YAML or JSON (the suffix says which)."""
    if rng.random() < 0.5:
        path = path.with_suffix(".json")
        path.write_text(json.dumps(data))
    else:
        path.write_text(yaml.dump(data, Dumper=DUMPER))
    return path


def config_cases(rng: random.Random, files: dict[str, Path], tmp: Path, n: int) -> Iterator[Case]:
    """Config files: structural mutations of valid ones, syntax damage, bad paths."""
    bad_paths = [tmp / "missing.yaml", tmp / "dir.yaml", tmp / "binary.yaml",
                 files["local"].with_suffix(".ini")]
    bases = {c: yaml.safe_load(files[c].read_text()) for c in CONFIGS}
    for i in range(n):
        command = rng.choice(list(CONFIGS))
        prefix, base = CONFIGS[command][1], bases[command]
        roll = rng.random()
        if roll < 0.6:
            data, names, kind = mutate_mapping(rng, base)
            path = dump(rng, data, tmp / f"case{i}.yaml")
            needles = names if kind != "top" else (str(path),)
        elif roll < 0.95:
            path, kind = tmp / f"case{i}.yaml", "syntax"
            path.write_text(damage_text(rng, files[command].read_text()))
            needles = (str(path), *{str(k) for p in leaf_paths(base) for k in p})
        else:
            path, kind = rng.choice(bad_paths), "path"
            needles = (str(path),)
        yield Case(command, [*prefix, "--config", str(path), "--check"], needles, kind)


def base_argv(command: str, files: dict[str, Path]) -> list[str]:
    """A valid command line of `command` that starts and writes nothing."""
    return {"local": ["local", "--check"], "train": ["train", "--check"],
            "store": ["store", "--check"],
            "rollout": ["rollout", "--config", str(files["rollout"]), "--check"],
            "model": ["model", "tiny-moe", "--out", "out/model", "--check"],
            "plan": ["plan", "--config", str(files["train_plan"]), "--gpu-memory-gib", "80",
                     "--seq-len", "64"]}[command]


def flag_cases(files: dict[str, Path], tmp: Path) -> Iterator[Case]:
    """Every flag of every command with every junk value; a missing value; unknown flags."""
    for command, flags in FLAGS.items():
        base = base_argv(command, files)
        for flag, (needles, kind) in flags.items():
            values = JUNK_FLAGS + ([str(tmp / "dir.yaml"), str(tmp / "binary.yaml"),
                                    str(tmp / "model.json")] if kind == "path" else [])
            for value in values:
                extra = (value.partition("=")[0],) if flag == "--set" else ()
                extra += (value.strip() or repr(value), repr(value)) if kind == "path" and value \
                    else ()
                yield Case(command, [*base, flag, value], (*needles, *extra), "flag")
            yield Case(command, [*base, flag], needles, "flag without value")
        yield Case(command, [*base, "--zz-typo"], ("--zz-typo",), "unknown flag")
        yield Case(command, [*base, "--log-level", "loud"], ("--log-level",), "flag")
        yield Case(command, [*base, "zz"], ("zz",), "stray argument")
    for uri in ["", "nope", "hf://", "s3:/x", "://x", "file:// x"]:
        yield Case("model", ["model", "fetch", "--uri", uri, "--out", "out/f", "--check"],
                   ("--uri",), "uri")


def manifest_cases(rng: random.Random, tmp: Path, n: int) -> Iterator[Case]:
    """k8s/ specs mutated: fields dropped or retyped, documents replaced, syntax damage."""
    sources = [(p.read_text(), [d for d in yaml.safe_load_all(p.read_text()) if d])
               for p in MANIFESTS]
    fixed = [tmp / "missing.yaml", tmp / "dir.yaml", tmp / "binary.yaml"]
    for i in range(n):
        text, docs = rng.choice(sources)
        path = tmp / f"manifest{i}.yaml"
        roll = rng.random()
        if roll < 0.55:
            docs = copy.deepcopy(docs)
            j = rng.randrange(len(docs))
            docs[j], _, kind = mutate_mapping(rng, docs[j])
            path.write_text(yaml.dump_all(docs, Dumper=DUMPER))
        elif roll < 0.9:
            path.write_text(damage_text(rng, text))
            kind = "syntax"
        elif roll < 0.97:
            path.write_text(rng.choice(["just text\n", "- 1\n- 2\n", "42\n", "", "---\n",
                                        "a: 1\n", "kind: RayJob\n", "[1, 2\n"]))
            kind = "not k8s"
        else:
            path, kind = rng.choice(fixed), "path"
        argv = ["plan", "--manifest", str(path)] + (["--check-expected"] if i % 2 else [])
        yield Case("plan", argv, (str(path),), kind)
