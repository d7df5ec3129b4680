"""The model-family registry (services.common.families): every family has what each consumer
reads, and a family added by one registration (here a copy of an existing one under a new name,
registered inside the test) is picked up by the megatron backend, the HF backend, the rollout
service, `r3flow local` and the planner without touching another file."""

from __future__ import annotations

import dataclasses
import pkgutil
from types import SimpleNamespace

import pytest

from services.common import families
from services.common.families import Family
from services.common.tiny_moe import TinyMoeConfig

TINY = TinyMoeConfig(num_layers=2)


@pytest.mark.parametrize("name", families.names())
def test_every_family_has_what_each_consumer_reads(name: str) -> None:
    from trainer.hf.routers import RULES
    from trainer.megatron.family_arch import FamilyArch
    from trainer.megatron.hf_mapping import arch_from_hf_config

    fam = families.get(name)
    cfg = fam.tiny_config(TINY).to_dict()
    assert cfg["model_type"] == name  # the registry key is the HF model_type
    assert fam.hf_routers and set(fam.hf_routers.values()) <= set(RULES), fam.hf_routers
    dtype, why = fam.engine_router_dtype
    assert dtype in ("fp32", "native") and why
    assert fam.megatron_arch is not None  # every family is mapped today
    arch = families.hook(fam.megatron_arch)(cfg)
    assert isinstance(arch, FamilyArch)
    # the family's own weight mapping (hf_mapping calls it): both directions or neither, the
    # experts' exactly for a fused-expert family, MLA's attention exactly where vLLM runs MLA
    own = arch.mapping
    assert (own.attention_to_megatron is None) == (own.attention_to_hf is None)
    assert (own.experts_to_megatron is None) == (own.experts_to_hf is None)
    assert (own.experts_to_megatron is not None) == arch.fused_experts
    assert (arch.mla is not None) == fam.mla == (own.attention_to_megatron is not None)
    # the expert width megatron reads (through the family's shape)
    assert arch_from_hf_config(cfg).moe_ffn == TINY.moe_intermediate_size
    assert fam.engine_dtype in (None, "bfloat16", "float32")
    assert set(fam.hf_knobs) <= {"attn_implementation", "packing"}
    for model_name, build in fam.planner_models.items():
        assert build()["model_type"] == name, model_name
    assert fam.shape is not None  # the planner's reading of its config.json
    assert families.model_shape(cfg).experts == TINY.num_experts


def test_one_module_per_family_named_after_it() -> None:
    mods = [m.name for m in pkgutil.iter_modules(families.__path__) if not m.name.startswith("_")]
    assert sorted(mods) == sorted(families.names())
    assert families.names()[0] == families.DEFAULT == "qwen3_moe"
    ranks = [f.rank for f in families.all_families()]
    assert len(set(ranks)) == len(ranks), ranks  # rank orders listings: no ties


def test_lookups_refuse_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="family: 'llama' is not one of qwen3_moe, qwen2_moe"):
        families.get("llama")
    assert families.find("llama") is None and families.find(None) is None
    with pytest.raises(ValueError, match="family: 'olmoe' is registered twice"):
        families.register(families.get("olmoe"))
    monkeypatch.setattr(families, "REGISTRY", dict(families.REGISTRY))  # a refusal adds nothing
    with pytest.raises(ValueError, match="family 'olmoe_copy': rank 3 is taken by 'olmoe'"):
        families.register(dataclasses.replace(families.get("olmoe"), name="olmoe_copy"))
    assert families.register(dataclasses.replace(families.get("olmoe"), name="olmoe_copy",
                                                  rank=92)).rank == 92
    with pytest.raises(ValueError, match="family hook 'trainer.megatron.family_basic:nope'"):
        families.hook("trainer.megatron.family_basic:nope")


@pytest.fixture
def copied(monkeypatch: pytest.MonkeyPatch) -> dict[str, Family]:
    """Two throwaway families, copies of GPT-OSS and DeepSeek-V3 under new names (their tiny
    models keep the original model_type: the builders are shared), one new router class and one
    new planner model; registered for this test only."""
    out = {
        "gpt_oss": dataclasses.replace(
            families.get("gpt_oss"), name="gpt_oss_copy", rank=90,
            hf_routers={"CopiedTopKRouter": "topk_softmax"},
            planner_models={"copy-tiny": lambda: {"model_type": "gpt_oss_copy"}}),
        "deepseek_v3": dataclasses.replace(families.get("deepseek_v3"), name="dsv3_copy",
                                           rank=91, engine_router_dtype=("fp32", "copied")),
    }
    for fam in out.values():
        monkeypatch.setitem(families.REGISTRY, fam.name, fam)
    return out


def test_a_registered_family_reaches_local_and_the_planner(copied, tmp_path) -> None:
    from services.local.config import LocalConfig
    from services.local.family import plan
    from trainer.plan.models import known_names, load_model_config

    assert LocalConfig(family="gpt_oss_copy").family == "gpt_oss_copy"
    p = plan("gpt_oss_copy", "hf", TINY)
    assert (p.hf, p.engine_dtype) == ({"attn_implementation": "eager", "packing": False},
                                      "bfloat16")
    assert plan("gpt_oss_copy", None, TINY).backend == "megatron"
    assert "copy-tiny" in known_names()
    assert load_model_config("copy-tiny") == {"model_type": "gpt_oss_copy"}
    assert families.build_family(tmp_path / "m", "gpt_oss_copy", TINY).is_dir()


def test_a_registered_family_reaches_the_backends_and_rollout(copied) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from services.rollout.engine import check_engine_layout
    from services.rollout.mla_rope import mla_model_types
    from trainer.hf.routers import find_routers
    from trainer.megatron.config import ModelConfig
    from trainer.megatron.families import check_supported, family_arch, supported
    from trainer.megatron.model import resolve_router_dtype

    # HF backend: a router class of the new family's is replayed with its rule
    model = AutoModelForCausalLM.from_config(families.hf_config("gpt_oss", TINY),
                                             dtype=torch.float32)
    gate = model.model.layers[0].mlp.router
    gate.__class__ = type("CopiedTopKRouter", (type(gate),), {})
    handles = find_routers(model)
    assert [(h.hf_layer, h.family) for h in handles] == [(0, "topk_softmax"),
                                                         (1, "topk_softmax")]
    # megatron backend: mapped through the family's hook, router dtype from its entry
    assert {"gpt_oss_copy", "dsv3_copy"} <= set(supported())
    cfg = dict(families.hf_config("gpt_oss", TINY).to_dict(), model_type="gpt_oss_copy")
    assert check_supported(cfg) == "gpt_oss_copy" and family_arch(cfg).attn_sinks
    assert resolve_router_dtype(ModelConfig(router_dtype="auto"), "dsv3_copy").router_dtype \
        == "fp32"
    bf16 = ModelConfig(dtype="bf16")  # experts: auto -> grouped on CUDA unless the family refuses
    assert bf16.fast_path(True, "dsv3_copy").experts == "grouped"
    assert bf16.fast_path(True, "gpt_oss_copy").experts == "sequential"
    # rollout service: the family's engine check and its MLA flag
    with pytest.raises(ValueError, match="GPT-OSS layout"):
        check_engine_layout(SimpleNamespace(model_type="gpt_oss_copy",
                                            layer_types=["full_attention"] * 2))
    assert "dsv3_copy" in mla_model_types()


def test_a_family_left_out_is_refused_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other direction: with olmoe taken out of the registry, each consumer refuses it."""
    from services.common.config import ConfigError, build_config
    from services.local.config import LocalConfig
    from trainer.megatron.families import check_supported

    monkeypatch.delitem(families.REGISTRY, "olmoe")
    with pytest.raises(ConfigError, match="family: .*'olmoe' is not one of"):
        build_config(LocalConfig, {"family": "olmoe"})
    with pytest.raises(ValueError, match="model_type: expected one of .* got 'olmoe'"):
        check_supported({"model_type": "olmoe"})
    with pytest.raises(ValueError, match="family: 'olmoe' is not one of"):
        families.hf_config("olmoe", TINY)
