"""The margin recipe's knobs (issue 57 item 4): TinyMoeConfig.router_aux_loss_coef goes into the
HF config, the warm start trains with megatron's aux load-balancing loss at it (GRPO does not),
and the published figures are moved to another depth consistently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common import families
from services.common.tiny_moe import TinyMoeConfig, hf_config
from services.local.warm_start import WarmStartConfig, trainer_config
from tests.support import router_margins as rm
from trainer.config import TrainerConfig


def test_the_coefficient_is_written_to_the_hf_config():
    assert hf_config(TinyMoeConfig()).router_aux_loss_coef == 0.0
    assert hf_config(TinyMoeConfig(router_aux_loss_coef=0.01)).router_aux_loss_coef == 0.01


def test_families_without_the_recipe_refuse_it_naming_the_field():
    with pytest.raises(ValueError, match="router_aux_loss_coef: only the qwen3_moe"):
        families.get("mixtral").tiny_config(TinyMoeConfig(router_aux_loss_coef=0.01))


def _checkpoint(tmp_path: Path, coef: float) -> Path:
    out = tmp_path / f"m{coef}"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_moe",
                                                 "router_aux_loss_coef": coef}))
    return out


def test_the_warm_start_trains_with_the_models_coefficient(tmp_path: Path):
    recipe = trainer_config(WarmStartConfig(model_dir=str(_checkpoint(tmp_path, 0.01))))
    plain = trainer_config(WarmStartConfig(model_dir=str(_checkpoint(tmp_path, 0.0))))
    assert recipe.model.aux_loss_coeff == 0.01
    assert plain.model.aux_loss_coeff == 0.0
    # GRPO's own trainer config: no load-balancing loss unless asked for
    assert TrainerConfig().model.aux_loss_coeff == 0.0


def test_the_hf_backend_refuses_a_load_balancing_warm_start(tmp_path: Path):
    cfg = WarmStartConfig(model_dir=str(_checkpoint(tmp_path, 0.01)), backend="hf")
    with pytest.raises(ValueError, match="backend: router_aux_loss_coef 0.01 .* needs the "
                       "megatron backend"):
        trainer_config(cfg)


def test_the_published_band_moves_with_depth():
    band48 = rm.published_band(48)
    # at the paper's own depth the low end is its 94% of tokens, the high end ~6 of 48 routers
    assert band48["token_mismatch_lo"] == pytest.approx(rm.PUBLISHED["token_mismatch"])
    assert band48["router_mismatch_hi"] * 48 == pytest.approx(rm.PUBLISHED["routers_per_token"])
    band7 = rm.published_band(7)
    assert band7["router_mismatch_lo"] == band48["router_mismatch_lo"]  # per layer: unchanged
    assert 0.30 < band7["token_mismatch_lo"] < band7["token_mismatch_hi"] < 0.65
    assert rm.at_depth(rm.per_layer_rate(0.5, 7), 7) == pytest.approx(0.5)
    assert band7["slot_agreement_lo"] < band7["slot_agreement_hi"] < 1.0
