"""No silent wrong update (issue 28), on both backends, 1 CPU rank: a non-finite update is
skipped and its group quarantined; a NaN rollout logprob is refused before the step; one
randomised MoE layer of one trajectory is caught per (unit, MoE layer) among 7 and among 48
layers (leading dense ones included) and its group quarantined, not a crash; the step's
metrics name the model's layer and count the skipped update (issue 43).

Rollout samples come from a plain transformers forward of the checkpoint (a perfect fp32
engine: natural routing, its logprobs). tests/integration/test_trainer_guard_ranks.py runs the
same faults on 2 gloo ranks where only one rank hits them.
Legend: T rows, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from trainer_fixtures import TINY, natural_samples, randomise_layer

from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

pytestmark = pytest.mark.timeout(300)


def _cfg(model_dir, backend: str, **kw):
    from trainer.config import TrainerConfig

    return TrainerConfig.model_validate(dict(
        model_dir=str(model_dir), backend=backend, data={"micro_batch_size": 2},
        optim={"lr": 1e-3}, replay={"agreement_floor": 0.5}) | kw)


def params(tr) -> dict[str, torch.Tensor]:
    module = tr.backend.policy.module if tr.cfg.backend == "megatron" else tr.backend.model
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def changed(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


def finite(p: dict) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in p.values())


@pytest.fixture(scope="module")
def dir2(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("tiny2"), TinyMoeConfig(num_layers=2, **TINY))


@pytest.fixture(scope="module", params=["megatron", "hf"])
def trainer2(request, dir2):
    from trainer.backend import make_trainer

    natural_samples(dir2, [0.0])  # transformers loads before any process group exists
    return make_trainer(_cfg(dir2, request.param,
                             data={"micro_batch_size": 2, "old_logprobs": "rollout"}))


# ---------------------------------------------------------------- finite-update guard
def test_nonfinite_probe_changes_no_parameter_quarantines_and_the_next_step_trains(
        trainer2, dir2):
    """The issue's probe: a step whose only group has a non-finite loss (a NaN reward; a NaN
    rollout logprob is now refused before the step, below): no parameter changes, the group
    quarantined, the step skipped and counted; the next step trains."""
    poison = natural_samples(dir2, [0.0, 1.0], seed=1)
    poison[0].reward = float("nan")
    before = params(trainer2)
    m = trainer2.train_step(poison)
    assert m["dropped"] == {"g0": "non_finite"} and m.get("skipped")
    assert (m["updates_skipped"], m["updates_rerun"]) == (1, 1)  # redone with nothing left
    after = params(trainer2)
    assert not changed(before, after)
    nxt = trainer2.train_step(natural_samples(dir2, [0.0, 1.0, 1.0, 0.0], seed=2))
    assert nxt["dropped"] == {} and np.isfinite(nxt["grad_norm"]) and nxt["grad_norm"] > 0
    assert (nxt["updates_skipped"], nxt["updates_rerun"]) == (0, 0)
    assert changed(after, params(trainer2)) and finite(params(trainer2))


def numbers(m: dict, at: str = "") -> dict[str, float]:
    """Every number in a step's metrics, nested dicts flattened (key path -> value)."""
    out: dict[str, float] = {}
    for k, v in m.items():
        if isinstance(v, dict):
            out |= numbers(v, f"{at}{k}.")
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[f"{at}{k}"] = float(v)
    return out


@pytest.mark.parametrize("backend", ["megatron", "hf"])
def test_a_nan_rollout_logprob_is_refused_counted_and_every_metric_finite(dir2, backend):
    """old_logprobs: trainer, where the NaN never reached the loss but made logprob_diff_* NaN
    (issue 43): its group is refused before any pass, counted; every metric is finite and the
    other group trains."""
    from trainer.backend import make_trainer

    tr = make_trainer(_cfg(dir2, backend, data={"micro_batch_size": 2, "old_logprobs": "trainer"},
                           replay={"agreement_floor": 0.5, "compare_off": True}))
    samples = natural_samples(dir2, [0.0, 1.0, 1.0, 0.0], seed=7)
    samples[1].rollout_logprobs[2] = float("nan")  # trajectory t1, group g0
    before = params(tr)
    m = tr.train_step(samples)
    assert m["dropped"] == {"g0": "non_finite_logprobs"} and m["trajectories"] == 2
    assert (m["updates_skipped"], m["updates_rerun"]) == (0, 0)  # refused, nothing faulted
    got = numbers(m)
    assert {"logprob_diff_mean", "logprob_diff_max", "logprob_diff_mean_off", "grad_norm",
            "loss", "routing_agreement"} <= set(got), sorted(got)
    assert all(np.isfinite(v) for v in got.values()), {k: v for k, v in got.items()
                                                       if not np.isfinite(v)}
    assert changed(before, params(tr)) and finite(params(tr))


def test_injected_nan_quarantines_only_its_group_and_the_rest_trains(trainer2, dir2):
    samples = natural_samples(dir2, [0.0, 1.0, 1.0, 0.0], seed=3)
    samples[2].reward = float("nan")  # a broken verifier: group g1's advantages are NaN
    before = params(trainer2)
    m = trainer2.train_step(samples)
    assert m["dropped"] == {"g1": "non_finite"} and m["trajectories"] == 2
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
    assert changed(before, params(trainer2)) and finite(params(trainer2))


# ---------------------------------------------------------------- agreement per (unit, layer)
@pytest.mark.parametrize("num_layers,dense", [(7, 2), pytest.param(48, 3, marks=pytest.mark.manual)])
@pytest.mark.parametrize("backend", ["megatron", "hf"])
def test_one_randomised_layer_of_one_trajectory_is_caught_and_quarantined(
        tmp_path, num_layers, dense, backend):
    """Leading dense layers make the MoE index differ from the model's layer number: the
    error, `routing_agreement_worst(_layer)` and `routing_agreement_by_layer` all name the
    model's layer; the step's metrics keep the faulting pass's worst cell (not the re-run's)
    and count the skipped, re-run update (issue 43)."""
    from trainer.backend import make_trainer
    from trainer.replay import ReplayMode, RoutingAgreementError

    model_dir = build_tiny_moe(tmp_path, TinyMoeConfig(num_layers=num_layers, first_k_dense=dense,
                                                       **TINY))
    samples = natural_samples(model_dir, [0.0, 1.0, 1.0, 0.0], seed=4)
    tr = make_trainer(_cfg(model_dir, backend))
    bad = (num_layers - dense) // 2  # MoE index
    layer = dense + bad  # the model's layer number
    randomise_layer(samples[3], bad)  # trajectory t3, group g1
    mbs = tr.prepare(samples)
    with pytest.raises(RoutingAgreementError) as err:
        tr.old_policy_pass(mbs, ReplayMode.R3)
    assert set(err.value.bad_groups) == {"g1"}, str(err.value)[:3000]
    assert re.search(rf"at trajectory t3 (prompt|segment 0) \(group g1\) MoE layer {bad} "
                     rf"\(HF layer {layer}\)", str(err.value))
    m = tr.train_step(samples)
    assert m["dropped"] == {"g1": "routing_agreement"} and m["trajectories"] == 2
    assert (m["updates_skipped"], m["updates_rerun"]) == (1, 1)
    assert m["routing_agreement_worst_layer"] == layer, m["routing_agreement_worst"]
    assert re.search(rf"trajectory t3 .*\(group g1\) MoE layer {bad} \(HF layer {layer}\)",
                     m["routing_agreement_worst"])
    assert m["routing_agreement_min"] < 0.5 <= m["routing_agreement"]  # below the floor
    assert set(m["routing_agreement_by_layer"]) == set(range(dense, num_layers))
    assert np.isfinite(m["grad_norm"])


def test_floor_over_chance_reads_the_same_for_any_expert_count():
    from trainer.config import ReplayConfig

    cfg = ReplayConfig(agreement_floor=0.5, agreement_floor_kind="over_chance")
    assert cfg.floor(2, 8) == pytest.approx(0.25 + 0.5 * 0.75)
    assert cfg.floor(8, 128) == pytest.approx(1 / 16 + 0.5 * 15 / 16)
    assert ReplayConfig(agreement_floor=0.3).floor(8, 128) == 0.3
