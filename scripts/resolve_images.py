"""Resolve each image's requirement set with pip's resolver, for linux x86_64 and the image's
Python, against the package registry (`pip install --dry-run --report`; nothing is installed),
and check the versions docker/versions.env records (make chart-check; issue 42).

  store:   docker/requirements-store.txt on Python STORE_PYTHON
  rollout: vllm==VLLM's base (its torch pin) + docker/requirements-store.txt on GPU_PYTHON
  trainer: the same base + docker/requirements-store.txt + docker/requirements-trainer.txt

The GPU images install vLLM from their base image (vllm/vllm-openai), so the resolve takes the
base's torch as the pin vLLM VLLM declares (read from its metadata, checked = TORCH) and adds the
requirement files on top, as `pip install -r` does in the Dockerfiles; torch and the NCCL wheel
must come out equal in rollout and trainer and equal to TORCH and NCCL.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(28, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]


def versions() -> dict[str, str]:
    out = {}
    for line in (ROOT / "docker" / "versions.env").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, value = line.split("=", 1)
            out[key] = value
    return out


def resolve(reqs: list[str], python: str, no_deps: bool = False) -> dict[str, dict]:
    """name -> metadata of what pip would install for `reqs` on linux x86_64 / `python`."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
               "--disable-pip-version-check", "--ignore-requires-python",  # checked below
               "--target", str(Path(tmp) / "t"), "--report",
               str(report), "--python-version", python, "--only-binary=:all:",
               *(a for p in PLATFORMS for a in ("--platform", p)),
               *(["--no-deps"] if no_deps else []), *reqs]
        env = dict(os.environ, PIP_CONSTRAINT="")  # the image's resolve, not this machine's pins
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if proc.returncode:
            err = [ln for ln in proc.stderr.splitlines() if not ln.startswith("WARNING")]
            raise SystemExit(f"resolve_images: {' '.join(reqs)} (Python {python}) does not "
                             f"resolve:\n" + "\n".join(err[-6:]))
        data = json.loads(report.read_text())
    out = {re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): i["metadata"]
           for i in data["install"]}
    # pip checks Requires-Python against this interpreter in places, not --python-version: it
    # is ignored above and checked here against the image's Python
    bad = [f"{m['name']} {m['version']} requires Python {m['requires_python']}"
           for m in out.values() if m.get("requires_python")
           and f"{python}.0" not in SpecifierSet(m["requires_python"])]
    if bad:
        raise SystemExit(f"resolve_images: on Python {python}: " + "; ".join(bad))
    return out


def pin(metadata: dict, name: str) -> str:
    """The == pin of `name` in `metadata`'s requirements."""
    for dep in metadata.get("requires_dist") or []:
        m = re.match(rf"{name}==([^;\s,]+)", dep.replace(" ", ""))
        if m:
            return m.group(1)
    raise SystemExit(f"resolve_images: {metadata['name']} {metadata['version']} pins no {name}")


def main() -> int:
    v = versions()
    files = {n: str(ROOT / "docker" / f"requirements-{n}.txt") for n in ("store", "trainer")}
    vllm = resolve([f"vllm=={v['VLLM']}"], v["GPU_PYTHON"], no_deps=True)["vllm"]
    base_torch = pin(vllm, "torch")
    problems = [] if base_torch == v["TORCH"] else [
        f"vllm {v['VLLM']} pins torch {base_torch}, docker/versions.env says {v['TORCH']}"]
    sets = {"store": (["-r", files["store"]], v["STORE_PYTHON"]),
            "rollout": ([f"torch=={base_torch}", "-r", files["store"]], v["GPU_PYTHON"]),
            "trainer": ([f"torch=={base_torch}", "-r", files["store"], "-r", files["trainer"]],
                        v["GPU_PYTHON"])}
    got = {}
    for image, (reqs, python) in sets.items():
        pkgs = resolve(reqs, python)
        nccl = sorted(f"{n} {m['version']}" for n, m in pkgs.items() if n.startswith("nvidia-nccl"))
        torch = pkgs.get("torch", {}).get("version")
        got[image] = (torch, nccl)
        print(f"{image}: {len(pkgs)} packages resolve on linux x86_64 / Python {python}"
              + (f"; torch {torch}, {', '.join(nccl)}" if torch else ""))
        if image == "trainer" and pkgs["megatron-core"]["version"] != v["MEGATRON_CORE"]:
            problems.append(f"trainer: megatron-core {pkgs['megatron-core']['version']}, "
                            f"docker/versions.env says {v['MEGATRON_CORE']}")
    if got["rollout"] != got["trainer"]:
        problems.append(f"rollout and trainer resolve different torch/NCCL: {got['rollout']} vs "
                        f"{got['trainer']}")
    torch, nccl = got["trainer"]
    if torch != v["TORCH"] or [n.split()[1] for n in nccl] != [v["NCCL"]]:
        problems.append(f"trainer resolves torch {torch}, {nccl}; docker/versions.env says "
                        f"torch {v['TORCH']}, NCCL {v['NCCL']}")
    for p in problems:
        print(f"resolve_images: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
