"""`r3flow plan` counts routing replay's GPU memory at the configured length (issue 54): the
step's micro-batches' routing in the codec's dtype and the int64 router rows of the micro-batches
in flight, as the trainer allocates them (trainer.samples.batch, trainer.samples.alignment), in
its table and verdict."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from services import cli
from trainer.plan.layout import Arch, GiB, Layout
from trainer.plan.memory import plan
from trainer.plan.models import load_model_config
from trainer.samples.alignment import to_router_rows
from trainer.samples.batch import Sample, make_microbatch

QWEN = Arch.from_hf_config(load_model_config("Qwen3-30B-A3B"))
L, K, T = 48, 8, 131_072  # Qwen3-30B-A3B's MoE layers and top-k; a 128k sequence


def test_the_plan_counts_what_one_micro_batch_allocates():
    """A micro-batch of 2 padded sequences: its routing tensor on the device and its router
    rows, built by the trainer's own functions, are the bytes the plan counts per micro-batch."""
    rng = np.random.default_rng(0)
    seq, experts = 64, QWEN.experts
    samples = [Sample(tokens=rng.integers(0, 100, n), prompt_len=4,
                      rollout_logprobs=np.zeros(n - 4, np.float32),
                      loss_mask=np.ones(n - 4, bool),
                      routing_TLK=rng.integers(0, experts, (n - 1, L, K)).astype(np.uint8))
               for n in (seq, seq - 9)]
    mb = make_microbatch(samples, pad_multiple=8).to(torch.device("cpu"))
    rows = to_router_rows(mb.routing_BSLK)
    p = plan(QWEN, Layout(world=8, ep=8, micro_batch=2, seq_len=seq), gpu_gib=80)
    assert p.rows["replay ids"] == mb.routing_BSLK.numel() * mb.routing_BSLK.element_size()
    assert p.rows["replay rows"] == sum(r.numel() * r.element_size() for r in rows)
    assert rows[0].dtype == torch.int64 and mb.routing_BSLK.dtype == torch.uint8


def test_replay_at_128k_counts_the_step_s_ids_and_the_rows_in_flight():
    """32 groups of 8 over 8 ranks: 4 groups, 32 sequences of 128k per rank, each keeping its
    uint8 routing for the step (1.5 GiB in all); int64 router rows only for the micro-batch in
    flight (384 MiB, not 32 x); TP2 (SP) x PP2 halves a sequence's rows twice, and the first
    stage of the 1F1B pipeline has 2 micro-batches in flight; its ranks run their TP x PP
    group's groups."""
    lay = Layout(world=8, ep=8, seq_len=T, step_groups=32, group_size=8)
    rows = plan(QWEN, lay, gpu_gib=141).rows
    assert lay.microbatches == 32
    assert rows["replay ids"] == 32 * T * L * K == 1.5 * GiB
    assert rows["replay rows"] == 8 * T * L * K == 0.375 * GiB
    split = replace(lay, world=32, tp=2, pp=2)  # 1 group per rank, a TP x PP group's 4
    rows = plan(QWEN, split, gpu_gib=141).rows
    assert split.microbatches == 32
    assert rows["replay ids"] == 32 * T * L * K
    assert rows["replay rows"] == 2 * 8 * (T / 2) * (L / 2) * K
    # more than 256 experts: uint16 ids; r2 keeps the ids it recorded (this rank's, the same
    # dtype) and widens the one in flight; off nothing
    wide = replace(QWEN, experts=512)
    assert plan(wide, lay, gpu_gib=141).rows["replay ids"] == 2 * 32 * T * L * K
    r2 = plan(QWEN, replace(lay, replay="r2"), gpu_gib=141).rows
    assert r2["replay ids"] == 32 * T * L * K and r2["replay rows"] == 0.375 * GiB
    r2_split = plan(QWEN, replace(split, replay="r2"), gpu_gib=141).rows
    assert r2_split["replay ids"] == 32 * (T / 2) * (L / 2) * K
    off = plan(QWEN, replace(lay, replay="off"), gpu_gib=141).rows
    assert "replay rows" not in off and "replay ids" not in off


def test_a_128k_plan_s_replay_rows_do_not_grow_with_the_step_s_micro_batches():
    """Qwen3-30B-A3B at 128k on 16 H200s, the fast path and full recompute: 128 groups of 8 put
    64 sequences on each rank, whose replay ids take 3 GiB and whose router rows one micro-batch's
    384 MiB (they took 24 GiB when a pass kept every micro-batch's); the verdict's one line does
    not name them; an eighth of the groups shrinks the ids, not the rows."""
    lay = Layout(world=16, ep=8, seq_len=T, step_groups=128, group_size=8,
                 distributed_optimizer=True, attention="sdpa", chunked_logprobs=True,
                 recompute="full")
    p = plan(QWEN, lay, gpu_gib=141)
    assert p.rows["replay ids"] == 3 * GiB and p.rows["replay rows"] == 0.375 * GiB
    (note,) = [n for n in p.notes if n.startswith("does not fit")]
    assert "\n" not in note and "replay" not in note
    fewer = plan(QWEN, replace(lay, step_groups=16), gpu_gib=141)
    assert fewer.rows["replay ids"] == 0.375 * GiB and fewer.rows["replay rows"] == 0.375 * GiB


def test_cli_prints_the_replay_rows_at_the_configured_length(tmp_path, capsys):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("model_dir: /unused\nmodel: {dtype: bf16, expert_parallel: 8}\n"
                   "data: {groups_per_step: 64, micro_batch_size: 1}\n"
                   "run: {world_size: 8, launcher: ray}\n")
    args = ["plan", "--config", str(cfg), "--model", "Qwen3-30B-A3B", "--gpu-memory-gib", "141",
            "--seq-len", str(T), "--recompute", "full", "--group-size", "2"]
    assert cli.main(args) == 1
    out = capsys.readouterr().out  # 64 groups of 2 over 8 ranks: 16 sequences per rank
    assert "replay rows             0.38 GiB" in out and "replay ids              0.75 GiB" in out
    assert "routing of 16 micro-batch(es) of 1 x 131072 tokens" in out
    assert "widened to int64 for the 1 in flight" in out
