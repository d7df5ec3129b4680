"""`r3flow plan` against figures computed by hand from trainer/plan/memory.py's formulas."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from services import cli
from tests.bench import bench_megatron_parallel as bench_mp
from trainer.plan.layout import Arch, GiB, Layout
from trainer.plan.memory import plan
from trainer.plan.models import load_model_config

ROOT = Path(__file__).resolve().parents[2]
QWEN = Arch.from_hf_config(load_model_config("Qwen3-30B-A3B"))
TINY = Arch.from_hf_config(load_model_config("tiny-moe"))


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
    # unfused attention (local spec): fp32 softmax output + its bf16 cast, 32 heads x 8192^2,
    # in all 48 layers (recompute_moe keeps them), and megatron's bf16 score buffer
    assert p.rows["attention scores"] == 48 * 6 * 32 * 8192**2   # 576 GiB
    assert p.rows["attention buffer"] == 2 * 32 * 8192**2
    assert p.rows["logits + loss"] == 24 * 8192 * 151_936        # 6 fp32 logit-sized tensors
    # replay (r3), one micro-batch per rank (Layout.step_sequences unset): its uint8 routing
    # (128 experts) and its int64 router rows, all 48 layers (PP 1), all positions (TP 1)
    assert p.rows["replay ids"] == 8192 * 48 * 8 and p.rows["replay rows"] == 8 * 8192 * 48 * 8
    assert round(p.total / GiB, 2) == 721.62 and not p.fits


def test_a_plan_that_does_not_fit_names_what_to_change():
    lay = Layout(world=32, ep=8, recompute="moe", reference=True, seq_len=8192)
    (note,) = [n for n in plan(QWEN, lay, gpu_gib=80).notes if n.startswith("does not fit")]
    assert note == ("does not fit by 641.62 GiB; to change: attention scores 576.00 GiB: "
                    "model.attention: sdpa; optimizer 57.72 GiB: "
                    "optim.use_distributed_optimizer: true")
    fast = Layout(world=32, ep=8, distributed_optimizer=True, attention="sdpa",
                  chunked_logprobs=True, recompute="full", seq_len=8192)
    assert not [n for n in plan(QWEN, fast, gpu_gib=80).notes if n.startswith("does not")]
    (note,) = [n for n in plan(QWEN, fast, gpu_gib=24).notes if n.startswith("does not fit")]
    assert "split the experts further: model.expert_parallel" in note  # experts dominate


def test_qwen3_30b_a3b_does_not_fit_with_the_distributed_optimizer_alone():
    lay = Layout(world=32, ep=8, recompute="moe", reference=True, seq_len=8192,
                 distributed_optimizer=True)
    p = plan(QWEN, lay, gpu_gib=80)
    # dense DP = 32, expert DP = 32 / 8 = 4: 12 * (1,541,093,376/32 + 3,623,878,656/4)
    assert p.rows["optimizer"] == pytest.approx(12 * (1_541_093_376 / 32 + 3_623_878_656 / 4))
    # the optimizer shrinks 57.72 -> 10.66 GiB, but 48 layers of attention scores stay
    assert round(p.total / GiB, 2) == 674.56 and not p.fits


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
    # attention scores: 4 heads (q 128 / head dim 32) x 256^2 x micro-batch 2 = 524,288 per
    # layer, fp32 (the softmax output is the one tensor the PV matmul saves): 4 B x 2 layers
    scores = 2 * 4 * 256**2
    assert p.rows["attention scores"] == 4 * scores * 2 and p.rows["attention buffer"] == 4 * scores
    assert p.rows["logits + loss"] == 24 * 512 * 128
    assert p.rows["replay ids"] == 512 * 2 * 2 and p.rows["replay rows"] == 8 * 512 * 2 * 2
    assert p.total == (16 * n + 512 * 4 * 2 * 1_808 + 4 * scores * 3 + 24 * 512 * 128
                       + 9 * 2_048 + GiB)
    assert p.fits


def test_bad_layouts_name_the_field():
    with pytest.raises(ValueError, match=r"expert_parallel \(--ep\) 3"):
        plan(TINY, Layout(world=3, ep=3), gpu_gib=1)
    with pytest.raises(ValueError, match=r"world_size \(--world\) 6"):
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
    assert cli.main([*base, "--distributed-optimizer"]) == 1
    # the push's chunks are the embedding's 151,936 x 2048 x 2 B (622 MB), not the gloo bucket
    # (64 MiB): a chunk never splits a tensor; 6 of them in flight = 3.48 GiB
    out = capsys.readouterr().out
    assert "weight push             3.48 GiB" in out
    assert "678.08 GiB of 80.00 GiB: DOES NOT FIT" in out
    assert cli.main([*base, "--distributed-optimizer", "--recompute", "full", "--pp", "4"]) == 0
    assert "75.72 GiB of 80.00 GiB: fits" in capsys.readouterr().out


def test_spec_gpus_must_match_world_size(tmp_path, capsys):
    text = _spec_docs("qwen3-30b-a3b-grpo-r3.yaml").read_text().replace("world_size: 32",
                                                                         "world_size: 16")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert cli.main(["plan", "--manifest", str(bad)]) == 2
    assert "32 GPUs but run.world_size is 16" in capsys.readouterr().err


def test_named_run_fits_with_tp2_pp2_ep8_on_the_fast_path(capsys):
    """k8s/qwen3-30b-a3b-grpo-r3.yaml (issues 21, 30): TP2 (SP) x PP2 x DP8, EP8 x EDP2,
    distributed optimizer, the fast path (SDPA, chunked log-softmax) with MoE recompute: the
    figures its header states."""
    spec = str(_spec_docs("qwen3-30b-a3b-grpo-r3.yaml"))
    assert cli.main(["plan", "--manifest", spec, "--check-expected"]) == 0
    out = capsys.readouterr().out
    assert "52.18 GiB of 80.00 GiB: fits (+27.82 GiB)" in out and "fits (as expected)" in out
    lay = Layout(world=32, tp=2, pp=2, ep=8, recompute="moe", reference=True, seq_len=8192,
                 distributed_optimizer=True, attention="sdpa", chunked_logprobs=True)
    p = plan(QWEN, lay, gpu_gib=80)
    # experts: 24 of 48 layers over EP8 (expert TP 1); dense split over TP2 except norms/routers
    assert p.expert_params == 3_623_878_656 / 2 and lay.dp == 8 and lay.expert_dp == 2
    assert p.rows["optimizer"] == pytest.approx(12 * (p.dense_params / 8 + p.expert_params / 2))
    # SDPA keeps no scores: its fp32 logsumexp per query row and head (16 heads per TP rank),
    # in the stage's 24 layers, for PP = 2 micro-batches in flight (1F1B)
    assert p.rows["attention scores"] == 4 * 16 * 8192 * 24 * 2
    # chunked: bf16 logits + their gradient, and one 1,024-row chunk's fp32 temporaries
    assert p.rows["logits + loss"] == 4 * 8192 * 151_936 + 6 * 4 * 1024 * 151_936


def _bench_plan(tp: int, attention: str = "unfused", micro_batch: int = 1,
                chunked_logprobs: bool = False) -> float:
    """The planner's total (GiB, no overhead) as tests/bench/bench_megatron_parallel.py prints it:
    its own `_plan` (Layout of --gpus/--tp/--pp/--ep/--seq-len, distributed optimizer, MoE
    recompute) at its own `_hf_config` (Qwen3-30B-A3B widths, 8 layers), run's arguments."""
    args = argparse.Namespace(gpus=4, tp=tp, pp=1, ep=4, seq_len=4096, layers=8,
                              distributed_optimizer=True, recompute_moe=True, attention=attention,
                              micro_batch=micro_batch, chunked_logprobs=chunked_logprobs)
    return bench_mp._plan(args, bench_mp._hf_config(args.layers, small=False)) / GiB


@pytest.mark.parametrize("tp,measured", [(1, 68.0), (2, 52.3)])
def test_plan_matches_the_h100_measurement(tp, measured):
    """BENCHMARKS.md "Throughput and memory at Qwen3-30B-A3B widths (issue 21)": 4 x H100 80GB
    HBM3, `tests/bench/bench_megatron_parallel.py --gpus 4 --layers 8 --ep 4 [--tp 2]`,
    megatron-core 0.19.2 local spec, 2 sequences of 4,096 tokens per rank per step, micro-batch 1,
    distributed optimizer, MoE recompute, GRPO step (old-policy forward + update):
    `torch.cuda.max_memory_allocated` 68.0 GiB on every rank for EP4 x DP4 (sessions 4 and 5),
    52.3 GiB for TP2 (SP) x DP2, EP4. The planner fed the bench's own inputs must be within 15 %
    (before the attention-score, score-buffer and loss rows it said 31.7 and 28.8 GiB)."""
    predicted = _bench_plan(tp)
    assert abs(predicted - measured) / measured <= 0.15, (predicted, measured)


@pytest.mark.parametrize("tp,measured", [(1, 42.41), (2, 39.45)])
def test_plan_matches_the_fast_path_measurement(tp, measured):
    """BENCHMARKS.md "The fast path (issue 30)": the same bench with --experts grouped
    --attention sdpa on 4 x H200: 42.41 GiB (EP4) and 39.45 GiB (TP2 x EP4) on every rank.
    SDPA keeps no attention scores; the planner must be within 10 % (it says 42.1 / 39.2)."""
    predicted = _bench_plan(tp, "sdpa")
    assert abs(predicted - measured) / measured <= 0.10, (predicted, measured)


@pytest.mark.parametrize("tp,micro_batch,measured", [(1, 1, 34.30), (1, 2, 38.48),
                                                     (2, 1, 31.38), (2, 2, 36.35)])
def test_plan_matches_the_chunked_loss_measurement(tp, micro_batch, measured):
    """BENCHMARKS.md "Call 5" (issue 30): the fast path with loss.chunked_logprobs on 4 x H200,
    EP4 and TP2 x EP4 at micro-batch 1 and 2, the same peak on every rank. The chunked loss
    keeps no fp32 [B, S, V] tensor; the planner must be within 10 %."""
    predicted = _bench_plan(tp, "sdpa", micro_batch, chunked_logprobs=True)
    assert abs(predicted - measured) / measured <= 0.10, (predicted, measured)


def test_the_planned_loss_chunk_is_the_trainers():
    from trainer.losses.logprobs import CHUNK
    from trainer.plan.memory import LOSS_CHUNK_ROWS

    assert LOSS_CHUNK_ROWS == CHUNK
