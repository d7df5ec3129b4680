"""Resolve each image's requirement set with pip's resolver, for linux x86_64 and the image's
Python, against the package registry (`pip install --dry-run --report`; nothing is installed),
and check the versions docker/versions.env records (make chart-check; issue 42).

  store:   docker/requirements-store.txt on Python STORE_PYTHON
  rollout: vllm==VLLM's base (its torch pin) + docker/requirements-{store,rollout}.txt on GPU_PYTHON
  trainer: the same base + docker/requirements-store.txt + docker/requirements-trainer.txt

The GPU images install vLLM from their base image (vllm/vllm-openai), so the resolve takes the
base's torch as the pin vLLM VLLM declares (read from its metadata, checked = TORCH) and the
base's NCCL as the pin that torch declares (read from torch's metadata, checked = NCCL), and
adds the requirement files on top, as `pip install -r` does in the Dockerfiles; torch must come
out equal in rollout and trainer and equal to TORCH.

The NCCL wheel torch 2.11.0 pins (nvidia-nccl-cu13 2.28.9) is not on the registry (its newest
is 2.32.3): pip cannot resolve torch 2.11.0's closure at all. The base image brings that NCCL,
so the GPU sets resolve with uv (`uv pip compile`, the resolver scripts/gpu_vllm_stage.sh uses)
with torch's NCCL pin overridden away (a never-true marker): everything else in the set
resolves, and nothing in it asks for another NCCL (checked: no nvidia-nccl-* comes out).
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


def resolve_uv(reqs: list[str], python: str, drop: list[str]) -> dict[str, str]:
    """name -> version that `uv pip compile` picks for `reqs` on manylinux x86_64 / `python`,
    with the packages named in `drop` overridden away (the base image brings them)."""
    uv = Path(sys.executable).parent / "uv"
    with tempfile.TemporaryDirectory() as tmp:
        inp, over, lock = Path(tmp) / "in.txt", Path(tmp) / "over.txt", Path(tmp) / "lock.txt"
        inp.write_text("\n".join(reqs) + "\n")
        over.write_text("".join(f"{n}; sys_platform == 'never'\n" for n in drop))
        cmd = [str(uv), "pip", "compile", str(inp), "--override", str(over), "--python-version",
               python, "--python-platform", "x86_64-manylinux_2_28", "--only-binary", ":all:",
               "--no-annotate", "--no-header", "-q", "-o", str(lock)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                              env=dict(os.environ, UV_CONSTRAINT="", PIP_CONSTRAINT=""))
        if proc.returncode:
            raise SystemExit(f"resolve_images: {' '.join(reqs)} (Python {python}) does not "
                             f"resolve:\n" + "\n".join(proc.stderr.splitlines()[-6:]))
        out = {}
        for line in lock.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if "==" in line:
                name, version = line.split("==", 1)
                out[re.sub(r"[-_.]+", "-", name).lower()] = version.split(";")[0].strip()
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
    files = {n: str(ROOT / "docker" / f"requirements-{n}.txt")
             for n in ("store", "rollout", "trainer")}
    vllm = resolve([f"vllm=={v['VLLM']}"], v["GPU_PYTHON"], no_deps=True)["vllm"]
    base_torch = pin(vllm, "torch")
    problems = [] if base_torch == v["TORCH"] else [
        f"vllm {v['VLLM']} pins torch {base_torch}, docker/versions.env says {v['TORCH']}"]
    torch_meta = resolve([f"torch=={base_torch}"], v["GPU_PYTHON"], no_deps=True)["torch"]
    nccl_name = next((n for n in ("nvidia-nccl-cu13", "nvidia-nccl-cu12")
                      if any(d.replace(" ", "").startswith(f"{n}==")
                             for d in torch_meta.get("requires_dist") or [])), None)
    if nccl_name is None:
        raise SystemExit(f"resolve_images: torch {base_torch} pins no nvidia-nccl wheel")
    base_nccl = pin(torch_meta, nccl_name)
    print(f"base vllm/vllm-openai:v{v['VLLM']}: torch {base_torch} (vllm's pin), {nccl_name} "
          f"{base_nccl} (torch's pin)")
    if base_nccl != v["NCCL"]:
        problems.append(f"torch {base_torch} pins {nccl_name} {base_nccl}, docker/versions.env "
                        f"says NCCL {v['NCCL']}")
    store = resolve(["-r", files["store"]], v["STORE_PYTHON"])
    print(f"store: {len(store)} packages resolve on linux x86_64 / Python {v['STORE_PYTHON']}")
    sets = {"rollout": [f"torch=={base_torch}", "-r " + files["store"], "-r " + files["rollout"]],
            "trainer": [f"torch=={base_torch}", "-r " + files["store"], "-r " + files["trainer"]]}
    got = {}
    for image, reqs in sets.items():
        pkgs = resolve_uv(reqs, v["GPU_PYTHON"], drop=[nccl_name])
        nccl = sorted(n for n in pkgs if n.startswith("nvidia-nccl"))
        got[image] = pkgs.get("torch")
        print(f"{image}: {len(pkgs)} packages resolve on manylinux x86_64 / Python "
              f"{v['GPU_PYTHON']} (uv; {nccl_name} from the base); torch {got[image]}")
        if nccl:
            problems.append(f"{image}: the set asks for NCCL wheels besides torch's: {nccl}")
        if image == "trainer" and pkgs.get("megatron-core") != v["MEGATRON_CORE"]:
            problems.append(f"trainer: megatron-core {pkgs.get('megatron-core')}, "
                            f"docker/versions.env says {v['MEGATRON_CORE']}")
    if got["rollout"] != got["trainer"] or got["trainer"] != v["TORCH"]:
        problems.append(f"rollout and trainer resolve torch {got['rollout']} / {got['trainer']}; "
                        f"docker/versions.env says {v['TORCH']}")
    for p in problems:
        print(f"resolve_images: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
