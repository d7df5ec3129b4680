"""`r3flow plan` for the hf backend (FSDP2) against figures computed by hand from
trainer/plan/memory.py's formulas, and the HF job spec k8s/tiny-moe-hf.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest

from services import cli
from trainer.plan.layout import Arch, Layout
from trainer.plan.memory import plan
from trainer.plan.models import load_model_config

ROOT = Path(__file__).resolve().parents[2]
QWEN = Arch.from_hf_config(load_model_config("Qwen3-30B-A3B"))
TINY = Arch.from_hf_config(load_model_config("tiny-moe"))
N_TINY = 527_104  # test_plan.test_tiny_moe_fp32_figures
LAYER_TINY = 49_152 + 320 + 196_608 + 1_024  # attention + norms, experts, router


@pytest.mark.parametrize(("world", "group", "shard"), [(2, 0, 2), (8, 4, 4), (8, 0, 8)])
def test_fsdp_state_is_sharded_over_the_shard_group(world, group, shard):
    lay = Layout(world=world, fsdp=True, fsdp_shard_group=group, dtype="fp32", seq_len=256)
    p = plan(TINY, lay, gpu_gib=2, overhead_gib=1)
    assert p.dense_params + p.expert_params == pytest.approx(N_TINY / shard)
    assert p.rows["weights"] == pytest.approx(4 * N_TINY / shard)
    assert p.rows["grads"] == pytest.approx(4 * N_TINY / shard)
    assert p.rows["optimizer"] == pytest.approx(8 * N_TINY / shard)  # Adam moments, fp32
    # two layers' parameters in flight at fp32 (compute dtype) + one layer's fp32 gradient
    assert p.rows["gathered layers"] == (2 * 4 + 4) * LAYER_TINY
    assert f"sharded over {shard} rank(s), {world // shard} replica(s)" in p.notes[-1]


def test_qwen3_30b_a3b_on_fsdp2_needs_16_ranks_of_80_gib():
    lay = dict(fsdp=True, dtype="bf16", attention="sdpa", recompute="full", seq_len=8192)
    assert not plan(QWEN, Layout(world=8, **lay), gpu_gib=80).fits
    assert plan(QWEN, Layout(world=16, **lay), gpu_gib=80).fits
    # hybrid keeps the 8-rank shard group's state per rank: replicas do not help memory
    assert not plan(QWEN, Layout(world=64, fsdp_shard_group=8, **lay), gpu_gib=80).fits


def test_bad_shard_group_names_the_field():
    with pytest.raises(ValueError, match="hf.shard_group_size 3"):
        plan(TINY, Layout(world=4, fsdp=True, fsdp_shard_group=3), gpu_gib=1)


def test_hf_job_spec_is_planned_as_fsdp2_and_fits(capsys):
    spec = str(ROOT / "k8s" / "tiny-moe-hf.yaml")
    assert cli.main(["plan", "--manifest", spec, "--check-expected"]) == 0
    out = capsys.readouterr().out
    assert "gathered layers" in out and "sharded over 2 rank(s)" in out
    assert "expected: fits (as expected)" in out
