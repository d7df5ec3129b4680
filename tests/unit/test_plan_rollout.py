"""Rollout engines sized for the model (trainer/plan/rollout.py, issue 42): the smallest
power-of-two TP whose engine holds the bf16 weights and its batch's KV cache; `r3flow plan
--manifest` refuses a rendered rollout whose TP is not that one."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services import cli
from trainer.plan.layout import Arch, GiB
from trainer.plan.models import load_model_config
from trainer.plan.rollout import kv_bytes_per_token, plan_rollout

QWEN = Arch.from_hf_config(load_model_config("Qwen3-30B-A3B"))


def test_qwen3_30b_a3b_figures():
    # 48 layers x 4 KV heads x 128 dims x (K, V) x 2 B
    assert kv_bytes_per_token(QWEN) == 48 * 4 * 128 * 2 * 2
    assert 3.0e9 < QWEN.active_params() < 3.6e9  # "A3B"
    assert 30.0e9 < QWEN.total_params() < 31.0e9


@pytest.mark.parametrize(("seqs", "tp"), [(256, 4), (128, 4), (64, 2), (8, 1)])
def test_smallest_tp_that_holds_the_batch(seqs, tp):
    p = plan_rollout(QWEN, 80, 0.85, 8192, seqs)
    assert (p.tp, p.engines_per_node, p.fits) == (tp, 8 // tp, True)
    assert p.kv_tokens >= seqs * 8192
    if tp > 1:  # half the TP would not hold it
        from trainer.plan.rollout import engine_plan

        assert not engine_plan(QWEN, tp // 2, 80, 0.85, 8192, seqs, 8).fits
    assert p.weights_per_gpu == pytest.approx(QWEN.total_params() * 2 / tp)
    assert p.weights_per_gpu < 80 * GiB * 0.85


def test_a_batch_no_node_holds_is_reported_not_hidden():
    p = plan_rollout(QWEN, 24, 0.85, 32768, 1024)
    assert p.tp == 8 and not p.fits
    assert "DOES NOT hold the batch" in p.describe()


def _render_like(tmp_path: Path, tp: int, gpus: int) -> Path:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "r-rollout"},
          "data": {"rollout.yaml": yaml.safe_dump({"engine": {
              "tensor_parallel_size": tp, "gpu_memory_utilization": 0.85,
              "max_model_len": 8192, "max_num_seqs": 256}})}}
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {
        "name": "r-rollout", "annotations": {"r3flow.io/plan-model": "Qwen3-30B-A3B",
                                             "r3flow.io/plan-gpu-memory-gib": "80"}},
        "spec": {"template": {"spec": {
            "containers": [{"name": "w", "resources": {"limits": {"nvidia.com/gpu": gpus}}}],
            "volumes": [{"name": "config", "configMap": {"name": "r-rollout"}}]}}}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump_all([cm, sts]))
    return path


def test_plan_refuses_a_rollout_not_sized_as_planned(tmp_path, capsys):
    assert cli.main(["plan", "--manifest", str(_render_like(tmp_path, 4, 4))]) == 0
    assert "rendered: TP 4: as planned" in capsys.readouterr().out
    assert cli.main(["plan", "--manifest", str(_render_like(tmp_path, 8, 8))]) == 1
    assert "set rollout.gpus to 4" in capsys.readouterr().out
