"""Non-Qwen models get a plan with a verdict (issue 58): a job spec and a chart render of a
Mixtral-8x7B and a DeepSeek-V3 trainer are planned from their family's reading of config.json
(services/common/families/<name>.py `shape`), never refused for a missing Qwen key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import API_VERSIONS, CHART, run_helm

from services import cli
from trainer.plan.layout import Arch
from trainer.plan.manifest import plan_manifest, plan_rollouts
from trainer.plan.models import load_model_config

SPECS = Path(__file__).resolve().parent / "specs"


@pytest.mark.parametrize(("spec", "verdict"), [("mixtral-8x7b-grpo-r3.yaml", "fits"),
                                               ("deepseek-v3-grpo-r3.yaml", "DOES NOT FIT")])
def test_family_job_specs_plan_to_their_expected_verdict(spec, verdict, capsys):
    path = str(SPECS / spec)
    assert cli.main(["plan", "--manifest", path, "--check-expected"]) == 0
    out = capsys.readouterr().out
    assert f": {verdict} (" in out and "(as expected)" in out
    if verdict != "fits":  # the plan names what to change
        assert "does not fit by" in out and "to change: " in out


def test_deepseek_spec_counts_dense_layers_shared_experts_and_mla():
    (job,) = plan_manifest(SPECS / "deepseek-v3-grpo-r3.yaml")
    arch = Arch.from_hf_config(load_model_config("DeepSeek-V3"))
    # EP64: 58 MoE layers x 256 experts x 3 x 7168 x 2048 / 64 on each rank
    assert job.plan.expert_params == 58 * 256 * 3 * 7168 * 2048 / 64
    assert job.plan.expert_params + job.plan.dense_params < arch.total_params()
    assert arch.moe_layers == 58 and arch.shared_ffn == 2048 and arch.attention.mla


def _render(helm, tmp_path: Path, model: str) -> Path:
    """The chart with its trainer on, planned for `model`'s config.json (a file, as a user
    passes one) and a store that registers that model's routing layout."""
    cfg = load_model_config(model)
    config_json = tmp_path / model / "config.json"
    config_json.parent.mkdir()
    config_json.write_text(json.dumps(cfg))
    arch = Arch.from_hf_config(cfg)
    models = json.dumps([{"name": model, "num_experts": arch.experts, "top_k": arch.top_k,
                          "moe_layers": arch.moe_layers}])
    proc = run_helm(helm, "template", "ci", str(CHART), *API_VERSIONS,
                    "--set", "trainer.enabled=true", "--set", f"plan.model={config_json}",
                    "--set-json", f"store.models={models}")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / f"{model}.yaml"
    out.write_text(proc.stdout)
    return out


@pytest.mark.parametrize("model", ["Mixtral-8x7B", "DeepSeek-V3"])
def test_a_non_qwen_render_is_planned(helm, tmp_path, model, capsys):
    rendered = _render(helm, tmp_path, model)
    arch = Arch.from_hf_config(load_model_config(model))
    (job,) = plan_manifest(rendered)
    assert job.plan.total > 0 and job.plan.fits == (job.plan.total <= job.plan.gpu_bytes)
    (rollout,) = plan_rollouts(rendered)
    assert rollout.plan.total_params == arch.total_params()
    assert rollout.plan.active_params == arch.active_params()
    if not rollout.plan.fits:  # DeepSeek-V3 on 80 GiB GPUs: the check says what to change
        assert "lower engine.max_num_seqs" in rollout.describe(model)
    # the CLI gives a verdict (0 fits, 1 does not or a rollout TP to change), never exit 2
    assert cli.main(["plan", "--manifest", str(rendered)]) in (0, 1)
    out = capsys.readouterr().out
    assert ": fits (" in out or "to change: " in out
