"""`r3flow plan` picks the recompute the memory budget allows (issue 44: less recompute where
memory allows): with recompute unset in the config, none when its estimate fits (overhead
included), else MoE recompute, else full; a recompute the config or `--recompute` sets is
planned as set. The budgets below sit between the planner's own totals, not at fixed figures."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from services import cli
from services.common.config import load_config
from tests.bench import bench_megatron_parallel as bench_mp
from trainer.config import TrainerConfig
from trainer.plan.layout import Arch, GiB, Layout
from trainer.plan.manifest import layout_from_trainer
from trainer.plan.memory import choose_recompute, plan
from trainer.plan.models import load_model_config

QWEN = Arch.from_hf_config(load_model_config("Qwen3-30B-A3B"))
# one H200's workload of issue 44: 4 layers, EP1, two 4K sequences in one micro-batch, fast path
LAY = Layout(world=1, seq_len=4096, micro_batch=2, distributed_optimizer=True,
             attention="sdpa", chunked_logprobs=True, recompute_set=False)
ARCH4 = replace(QWEN, num_layers=4, moe_layer_ids=(0, 1, 2, 3))


def _totals(arch: Arch, lay: Layout, overhead: float = 4.0) -> dict[str, float]:
    """GiB per rank of each recompute, planned as set."""
    return {r: plan(arch, replace(lay, recompute=r, recompute_set=True), 1000,
                    overhead_gib=overhead).total / GiB for r in ("none", "moe", "full")}


def test_unset_recompute_is_none_when_it_fits():
    t = _totals(ARCH4, LAY)
    assert t["full"] < t["moe"] < t["none"]  # recompute saves memory, none the most time
    budget = t["none"] + 0.5
    assert choose_recompute(ARCH4, LAY, budget) == ("none", pytest.approx({"none": t["none"] * GiB}))
    p = plan(ARCH4, LAY, budget)
    assert p.fits and p.total / GiB == pytest.approx(t["none"])
    assert p.recompute.startswith("recompute: none, the plan's pick (unset in the config)")
    assert f"none {t['none']:.2f}" in p.recompute
    # the planner's margin: the same budget without the 4 GiB overhead's room picks recompute
    assert choose_recompute(ARCH4, LAY, t["none"] - 0.5)[0] == "moe"


def test_unset_recompute_that_does_not_fit_names_the_setting_that_does():
    t = _totals(ARCH4, LAY)
    budget = (t["none"] + t["moe"]) / 2  # MoE recompute fits, none does not
    pick, tried = choose_recompute(ARCH4, LAY, budget)
    assert pick == "moe" and list(tried) == ["none", "moe"]
    p = plan(ARCH4, LAY, budget)
    # the verdict is of what the trainer runs with recompute unset (none): it does not fit
    assert not p.fits and p.total / GiB == pytest.approx(t["none"])
    assert "the plan's pick is moe (fits): set model.recompute_moe: true" in p.recompute
    budget = (t["moe"] + t["full"]) / 2  # only full recompute fits
    assert choose_recompute(ARCH4, LAY, budget)[0] == "full"
    assert "set model.recompute_granularity: full" in plan(ARCH4, LAY, budget).recompute
    # nothing fits: the least memory (full), said to still not fit
    assert "pick is full (still does not fit)" in plan(ARCH4, LAY, t["full"] - 1).recompute


def test_a_set_recompute_wins():
    t = _totals(ARCH4, LAY)
    budget = t["none"] + 0.5  # the pick would be none
    p = plan(ARCH4, replace(LAY, recompute="moe", recompute_set=True), budget)
    assert p.total / GiB == pytest.approx(t["moe"])
    assert p.recompute.startswith("recompute: moe, as set (the plan's pick would be none;")
    # set to none where none does not fit: planned as set, verdict DOES NOT FIT
    p = plan(ARCH4, replace(LAY, recompute="none", recompute_set=True), t["moe"] + 0.1)
    assert not p.fits and "recompute: none, as set (the plan's pick would be moe;" in p.recompute


def test_the_config_says_whether_recompute_is_set():
    """Set means given in the config, even to its default; fast_path() keeps it."""
    unset = TrainerConfig(model={"dtype": "bf16"})
    assert not unset.model.recompute_set and not unset.fast_path(True).model.recompute_set
    for model in ({"recompute_moe": False}, {"recompute_granularity": "none"},
                  {"recompute_moe": True}, {"recompute_granularity": "full"}):
        cfg = TrainerConfig(model={"dtype": "bf16", **model})
        assert cfg.model.recompute_set and cfg.fast_path(True).model.recompute_set
    lay = layout_from_trainer(unset, 4096)
    assert (lay.recompute, lay.recompute_set) == ("none", False)
    lay = layout_from_trainer(TrainerConfig(model={"recompute_moe": True}), 4096)
    assert (lay.recompute, lay.recompute_set) == ("moe", True)


def _config(tmp_path: Path, model: dict) -> str:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"model_dir": "/unused", "model": {"dtype": "bf16", **model},
                                    "data": {"micro_batch_size": 1},
                                    "run": {"world_size": 8, "launcher": "ray"}}))
    return str(path)


def test_cli_config_picks_and_the_flag_or_the_config_wins(tmp_path, capsys):
    """`r3flow plan --config` on Qwen3-30B-A3B, 8 ranks EP8, 8K tokens: the budget between the
    planner's none and moe totals."""
    path = _config(tmp_path, {"expert_parallel": 8})
    # groups of 8: `r3flow plan --config`'s default --group-size
    lay = layout_from_trainer(load_config(TrainerConfig, path), 8192, True, "qwen3_moe", 8)
    assert lay.ep == 8 and lay.attention == "sdpa" and not lay.recompute_set
    t = _totals(QWEN, lay)
    budget = f"{(t['none'] + t['moe']) / 2:.2f}"
    base = ["plan", "--model", "Qwen3-30B-A3B", "--gpu-memory-gib", budget, "--seq-len", "8192"]
    assert cli.main([*base, "--config", path]) == 1
    out = capsys.readouterr().out
    assert "recompute: unset in the config, so the trainer runs none, which does not fit; " \
           "the plan's pick is moe (fits): set model.recompute_moe: true" in out
    assert f"{t['none']:.2f} GiB of {float(budget):.2f} GiB: DOES NOT FIT" in out
    # --recompute moe (what the plan names) fits, planned as set
    assert cli.main([*base, "--config", _config(tmp_path, {"expert_parallel": 8}),
                     "--recompute", "moe"]) == 0
    out = capsys.readouterr().out
    assert "recompute: moe, as set (the plan's pick would be moe;" in out
    assert f"{t['moe']:.2f} GiB of {float(budget):.2f} GiB: fits" in out
    # the config's own recompute_moe: false wins over the pick
    assert cli.main([*base, "--config", _config(tmp_path, {"expert_parallel": 8,
                                                           "recompute_moe": False})]) == 1
    assert "recompute: none, as set (the plan's pick would be moe;" in capsys.readouterr().out
    # a larger GPU: none fits and is the pick
    big = ["plan", "--model", "Qwen3-30B-A3B", "--gpu-memory-gib", f"{t['none'] + 1:.2f}",
           "--seq-len", "8192", "--config", _config(tmp_path, {"expert_parallel": 8})]
    assert cli.main(big) == 0
    assert "recompute: none, the plan's pick (unset in the config)" in capsys.readouterr().out


def test_the_bench_runs_the_plans_pick_unless_given():
    """tests/bench/bench_megatron_parallel.py without --[no-]recompute-moe runs the pick for the
    GPU's memory (issue 44's one-H200 workload: none on 141 GiB); given, it runs as given."""
    cfg = bench_mp._hf_config(4, small=False)
    args = argparse.Namespace(gpus=1, tp=1, pp=1, ep=1, seq_len=4096, distributed_optimizer=True,
                              attention="sdpa", micro_batch=2, chunked_logprobs=True,
                              recompute_moe=None)
    t = _totals(Arch.from_hf_config(cfg), LAY)
    line = bench_mp._pick_recompute(args, cfg, 141.0)
    assert args.recompute_moe is False and "recompute: none, the plan's pick" in line
    args.recompute_moe = None
    bench_mp._pick_recompute(args, cfg, (t["none"] + t["moe"]) / 2)
    assert args.recompute_moe is True
    args.recompute_moe = True
    assert "plan's pick (unset" in bench_mp._pick_recompute(args, cfg, 141.0)
    assert args.recompute_moe is True  # given: kept
    args.recompute_moe = None
    with pytest.raises(SystemExit, match="picks full recompute"):
        bench_mp._pick_recompute(args, cfg, (t["moe"] + t["full"]) / 2)
