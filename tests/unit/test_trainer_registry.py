"""trainer.registry: the backends declare their TrainerConfig sections; the config names them by
dotted path only, validates every backend's section whatever the backend, and a fresh process
(a spawned rank, a Ray actor) validates a config without importing a backend first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from services.common.config import ConfigError, build_config
from trainer.config import TrainerConfig
from trainer.registry import BACKENDS, config_module, load_attr, section_type

ROOT = Path(__file__).resolve().parents[2]


def test_every_backend_is_a_choice_and_declares_fields_of_the_config() -> None:
    assert set(get_args(TrainerConfig.model_fields["backend"].annotation)) == set(BACKENDS)
    declared = {name: cls for b in BACKENDS for name, cls in config_module(b).SECTIONS.items()}
    assert declared.keys() == {"model", "hf"}
    cfg = TrainerConfig()
    for name, cls in declared.items():
        assert section_type(name) is cls and type(getattr(cfg, name)) is cls


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_section_of_either_backend_is_validated_whichever_is_selected(backend: str) -> None:
    with pytest.raises(ConfigError, match=r"hf\.packing: Input should be a valid boolean"):
        build_config(TrainerConfig, {"backend": backend, "hf": {"packing": "maybe"}})
    with pytest.raises(ConfigError, match=r"model\.dtyp: unknown key"):
        build_config(TrainerConfig, {"backend": backend, "model": {"dtyp": "bf16"}})
    kept = build_config(TrainerConfig, {"backend": backend, "hf": {"sequence_parallel": 2},
                                        "model": {"seed": 7}})
    assert (kept.hf.sequence_parallel, kept.model.seed) == (2, 7)  # kept, not dropped


def test_the_selected_backend_checks_the_whole_config() -> None:
    with pytest.raises(ConfigError, match=r"model\.expert_parallel: the hf backend"):
        build_config(TrainerConfig, {"backend": "hf", "model": {"expert_parallel": 2}})
    with pytest.raises(ConfigError, match=r"model\.tensor_parallel x pipeline_parallel"):
        build_config(TrainerConfig, {"run": {"launcher": "ray", "world_size": 3},
                                     "model": {"tensor_parallel": 2, "sequence_parallel": True}})


def test_a_fresh_process_validates_a_config_without_importing_a_backend_first() -> None:
    """What a spawned rank or a Ray actor does (RankWorker: model_validate_json)."""
    cfg = TrainerConfig(backend="hf", hf={"packing": False}, model={"dtype": "bf16"})
    code = ("import sys; from trainer.config import TrainerConfig; "
            "c = TrainerConfig.model_validate_json(sys.stdin.read()); "
            "print(type(c.model).__module__, type(c.hf).__module__, c.hf.packing, c.model.dtype)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, input=cfg.model_dump_json(),
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out == ["trainer.megatron.config", "trainer.hf.config", "False", "bf16"]


@pytest.mark.parametrize(("path", "says"), [
    ("json.dumps", "is not of the form"), ("no_such_module_c45:f", "cannot import"),
    ("json:no_such_attr", "has no attribute"), ("json:", "is not of the form")])
def test_a_bad_dotted_path_names_the_field(path: str, says: str) -> None:
    with pytest.raises(ValueError, match=f"^hooks.0: .*{says}"):
        load_attr(path, "hooks.0")
    assert load_attr("json:dumps", "f") is json.dumps


def test_typed_section_accessors_return_the_declared_sections() -> None:
    from trainer.hf.config import HFBackendConfig, hf_section
    from trainer.megatron.config import ModelConfig, model_section

    cfg = TrainerConfig.model_validate({"model": {"dtype": "bf16"}, "hf": {"packing": False}})
    assert isinstance(model_section(cfg), ModelConfig) and model_section(cfg).dtype == "bf16"
    assert isinstance(hf_section(cfg), HFBackendConfig) and hf_section(cfg).packing is False
    raw = cfg.model_copy(update={"model": {"dtype": "bf16"}, "hf": None})  # skips validation
    with pytest.raises(TypeError, match="model: expected a ModelConfig section, got dict"):
        model_section(raw)
    with pytest.raises(TypeError, match="hf: expected an HFBackendConfig section, got NoneType"):
        hf_section(raw)
