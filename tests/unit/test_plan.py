"""`r3flow plan` against figures computed by hand from trainer/plan/memory.py's formulas."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services import cli
from trainer.plan.memory import Arch, GiB, Layout, plan
from trainer.plan.models import QWEN3_30B_A3B, tiny_moe_config

ROOT = Path(__file__).resolve().parents[2]
QWEN = Arch.from_hf_config(QWEN3_30B_A3B)
TINY = Arch.from_hf_config(tiny_moe_config())


def test_qwen3_30b_a3b_parameters():
    # attention 2*2048*4096 + 2*2048*512 = 18,874,368 (+ norms 2*2048 + 2*128 = 4,352);
    # experts 128 * 3*2048*768 = 603,979,776 and router 2048*128 = 262,144 per layer;
    # embeddings + lm_head 2 * 151,936*2048 = 622,329,856; final norm 2048.
    layer = 18_874_368 + 4_352 + 603_979_776 + 262_144
    assert QWEN.total_params() == 48 * layer + 622_329_856 + 2048 == 30_532_122_624


def test_qwen3_30b_a3b_spec_today_does_not_fit():
    """k8s/qwen3-30b-a3b-grpo-r3.yaml: 32 ranks, EP=8, bf16, recompute_moe, kl_coef > 0."""
    lay = Layout(world=32, ep=8, recompute="moe", reference=True, seq_len=8192)
    p = plan(QWEN, lay, gpu_gib=80)
    # dense per rank: 48*18,874,368 + 622,329,856 + 48*(4,352 + 262,144) + 2048 = 1,541,093,376
    # experts per rank: 48 * 603,979,776 / 8 = 3,623,878,656 -> 5,164,972,032 params.
    assert p.dense_params == 1_541_093_376 and p.expert_params == 3_623_878_656
    n = 5_164_972_032
    assert p.rows["weights"] == 2 * n and p.rows["reference model"] == 2 * n
    assert p.rows["grads"] == 4 * n                      # grad_reduce_in_fp32
    assert p.rows["optimizer"] == 12 * n                 # 61.98 GB: not sharded
    # activations: 8192 tokens x 2 B x (48 x (attention 15,360 + MoE input 2,048)
    #   + one recomputed MoE block 2,048 + 8*(4,096 + 2,304) + 2*128*4/2 = 53,760)
    assert p.rows["activations"] == 8192 * 2 * (48 * 17_408 + 53_760)
    assert p.rows["logits"] == 8192 * 151_936 * 6        # bf16 logits + fp32 log-softmax
    assert p.rows["routing buffers"] == 8 * 8192 * 48 * 8
    assert round(p.total / GiB, 2) == 120.75 and not p.fits


def test_qwen3_30b_a3b_fits_with_the_distributed_optimizer():
    lay = Layout(world=32, ep=8, recompute="moe", reference=True, seq_len=8192,
                 distributed_optimizer=True)
    p = plan(QWEN, lay, gpu_gib=80)
    # dense DP = 32, expert DP = 32 / 8 = 4: 12 * (1,541,093,376/32 + 3,623,878,656/4)
    assert p.rows["optimizer"] == pytest.approx(12 * (1_541_093_376 / 32 + 3_623_878_656 / 4))
    assert round(p.total / GiB, 2) == 73.69 and p.fits


def test_tiny_moe_fp32_figures():
    """The tiny MoE (2 MoE layers, h 128, 8 experts top-2, f 64, vocab 128) in fp32."""
    # attention 2*128*128 + 2*128*64 = 49,152 (+ norms 2*128 + 2*32 = 320); experts
    # 8*3*128*64 = 196,608, router 1,024; embeddings + lm_head 2*128*128 = 32,768; norm 128.
    assert TINY.total_params() == 2 * (49_152 + 320 + 196_608 + 1_024) + 32_768 + 128 == 527_104
    lay = Layout(world=2, ep=2, dtype="fp32", micro_batch=2, seq_len=256)
    p = plan(TINY, lay, gpu_gib=2, overhead_gib=1)
    dense, expert = 2 * (49_152 + 320 + 1_024) + 32_768 + 128, 2 * 196_608 / 2
    assert (p.dense_params, p.expert_params) == (dense, expert)
    n = dense + expert                                    # 330,496
    assert p.rows["weights"] == 4 * n and p.rows["grads"] == 4 * n
    assert p.rows["optimizer"] == 8 * n                   # fp32: Adam moments only
    assert p.rows["reference model"] == 0
    # 512 tokens x 4 B x 2 layers x (attention 3*128 + 2*128 + 2*64 = 768
    #   + MoE 128 + 2*(256 + 192) + 2*8*4/4 = 1,040), no recompute
    assert p.rows["activations"] == 512 * 4 * 2 * (768 + 1_040)
    assert p.rows["logits"] == 512 * 128 * 8
    assert p.rows["routing buffers"] == 8 * 512 * 2 * 2
    assert p.total == 16 * n + 512 * 4 * 2 * 1_808 + 512 * 1024 + 16_384 + GiB
    assert p.fits


def test_bad_layouts_name_the_field():
    with pytest.raises(ValueError, match="expert_parallel 3"):
        plan(TINY, Layout(world=3, ep=3), gpu_gib=1)
    with pytest.raises(ValueError, match="world size 6"):
        plan(QWEN, Layout(world=6, ep=4), gpu_gib=80)


def _spec_docs(name: str) -> Path:
    return ROOT / "k8s" / name


# The named run before the distributed optimizer existed (EP=8 alone): a spec that does not fit.
UNSHARDED = ROOT / "tests" / "unit" / "plan_specs" / "qwen3-30b-a3b-ep8-unsharded-adam.yaml"


def test_cli_plans_the_named_run_and_checks_its_expected_verdict(capsys):
    spec = str(UNSHARDED)
    assert cli.main(["plan", "--manifest", spec]) == 1          # does not fit
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "expected: does-not-fit (as expected)" in out
    assert cli.main(["plan", "--manifest", spec, "--check-expected"]) == 0


def test_cli_config_what_if(tmp_path, capsys):
    cm = next(d for d in yaml.safe_load_all(UNSHARDED.read_text())
              if d and d["kind"] == "ConfigMap")
    cfg = tmp_path / "train.yaml"
    cfg.write_text(cm["data"]["train.yaml"])
    base = ["plan", "--config", str(cfg), "--model", "Qwen3-30B-A3B", "--gpu-memory-gib", "80",
            "--seq-len", "8192"]
    assert cli.main(base) == 1
    assert cli.main([*base, "--distributed-optimizer"]) == 0
    assert "73.69 GiB of 80.00 GiB: fits" in capsys.readouterr().out


def test_spec_gpus_must_match_world_size(tmp_path, capsys):
    text = _spec_docs("qwen3-30b-a3b-grpo-r3.yaml").read_text().replace("world_size: 32",
                                                                         "world_size: 16")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert cli.main(["plan", "--manifest", str(bad)]) == 2
    assert "32 GPUs but run.world_size is 16" in capsys.readouterr().err


def test_named_run_fits_with_tp2_ep8_and_the_distributed_optimizer(capsys):
    """k8s/qwen3-30b-a3b-grpo-r3.yaml (issue 21): TP2 (SP) x DP16, EP8 x EDP4, distributed
    optimizer, recompute_moe: the figures its header states."""
    spec = str(_spec_docs("qwen3-30b-a3b-grpo-r3.yaml"))
    assert cli.main(["plan", "--manifest", spec, "--check-expected"]) == 0
    out = capsys.readouterr().out
    assert "61.21 GiB of 80.00 GiB: fits (+18.79 GiB)" in out and "fits (as expected)" in out
    lay = Layout(world=32, tp=2, ep=8, recompute="moe", reference=True, seq_len=8192,
                 distributed_optimizer=True)
    p = plan(QWEN, lay, gpu_gib=80)
    # dense split over TP2 except norms/routers; experts over EP8 (expert TP 1)
    assert p.expert_params == 3_623_878_656 and lay.dp == 16 and lay.expert_dp == 4
    assert p.rows["optimizer"] == pytest.approx(12 * (p.dense_params / 16 + 3_623_878_656 / 4))
    assert p.rows["logits"] == 8192 * 151_936 * 6  # gathered over TP: the full vocabulary
