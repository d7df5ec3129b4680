"""`r3flow local --family`: the family is a validated config field, and it picks the trainer
backend (megatron where it maps the family, else hf), the hf knobs and the engine dtype the family
needs; a user who names megatron for a family it refuses fails at boot with the refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common import families
from services.common.config import ConfigError, build_config
from services.common.tiny_moe import TinyMoeConfig
from services.local.config import LocalConfig, rollout_config, trainer_config, warm_start_config
from services.local.family import megatron_refusal, plan
from services.local.warm_start import WarmStartConfig
from services.local.warm_start import trainer_config as warm_trainer_config
from trainer.config import TrainerConfig
from trainer.megatron.families import REFUSED, supported


def test_unknown_family_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="family: .*'llama' is not one of qwen3_moe, "):
        build_config(LocalConfig, {"family": "llama"})


@pytest.mark.parametrize("family", sorted(supported()))
def test_megatron_when_it_maps_the_family(family, tmp_path: Path):
    cfg = LocalConfig(family=family)
    p = plan(family, None, cfg.model)
    assert (p.backend, p.hf) == ("megatron", {})
    tc = TrainerConfig.model_validate(trainer_config(cfg, tmp_path, tmp_path, p))
    assert tc.backend == "megatron" and tc.run.launcher == "ray"  # the preset's


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_hf_when_megatron_refuses_the_family(family, tmp_path: Path, monkeypatch):
    """A refusal (every family is mapped today: one is simulated) sends the run to hf, with the
    family's hf knobs, the local launcher and the same backend for the warm start; a user who
    names megatron then fails at boot with the refusal."""
    from services.local import family as fam

    why = f"model_type: {family!r} is not supported by the megatron trainer: (simulated)"
    monkeypatch.setattr(fam, "megatron_refusal", lambda f, m: why if f == family else None)
    cfg = LocalConfig(family=family)
    p = plan(family, None, cfg.model)
    assert p.backend == "hf" and why in p.why and p.hf == families.get(family).hf_knobs
    tc = TrainerConfig.model_validate(trainer_config(cfg, tmp_path, tmp_path, p))
    assert (tc.backend, tc.run.launcher) == ("hf", "local")  # hf: one in-process rank
    warm = WarmStartConfig.model_validate(warm_start_config(cfg, tmp_path, tmp_path, tmp_path, p))
    assert warm_trainer_config(warm).backend == "hf"
    with pytest.raises(ConfigError, match=f"trainer.backend: megatron refuses family "
                       f"'{family}': model_type: '{family}' is not supported"):
        plan(family, "megatron", cfg.model)


def test_every_refusal_names_the_missing_piece():
    for family, why in REFUSED.items():
        assert why in (megatron_refusal(family, TinyMoeConfig()) or ""), family


def test_gpt_oss_needs_are_set_by_the_family(tmp_path: Path):
    cfg = LocalConfig(family="gpt_oss", trainer={"model": {"dtype": "fp32"}})
    p = plan("gpt_oss", "hf", cfg.model)
    tc = TrainerConfig.model_validate(trainer_config(cfg, tmp_path, tmp_path, p))
    assert (tc.hf.attn_implementation, tc.hf.packing) == ("eager", False)
    assert rollout_config(cfg, tmp_path, tmp_path, 0, p)["engine"]["dtype"] == "bfloat16"


def test_the_users_backend_wins(tmp_path: Path):
    p = plan("qwen2_moe", "hf", TinyMoeConfig())
    assert (p.backend, p.why) == ("hf", "set by the user")
    assert rollout_config(LocalConfig(), tmp_path, tmp_path, 0, p)["engine"]["dtype"] == "bfloat16"
