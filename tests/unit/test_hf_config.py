"""The hf backend's launcher and sharding settings: Ray ranks are accepted, a bad sharding is a
one-line error naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.common.config import ConfigError, build_config
from trainer.config import TrainerConfig
from trainer.hf.config import HFBackendConfig


def _cfg(world: int = 2, **hf) -> TrainerConfig:
    return TrainerConfig(backend="hf", hf=hf,
                         run={"launcher": "ray" if world > 1 else "local", "world_size": world})


def test_ray_launcher_is_accepted_for_the_hf_backend():
    assert _cfg(4).run.launcher == "ray"
    assert _cfg(8, sharding="hybrid", shard_group_size=4).hf.mesh_shape(8) == (2, 4)
    assert HFBackendConfig().mesh_shape(4) == (4,)
    assert HFBackendConfig(sharding="hybrid").mesh_shape(4) == (1, 4)


@pytest.mark.parametrize(("world", "hf", "field"), [
    (2, {"sharding": "zero3"}, "hf.sharding"),
    (6, {"sharding": "hybrid", "shard_group_size": 4}, "hf.shard_group_size"),
    (4, {"shard_group_size": 2}, "hf.shard_group_size"),
    (2, {"fsdp": "off"}, "hf.fsdp"),
    (4, {"sequence_parallel": 3}, "hf.sequence_parallel"),
    (2, {"sequence_parallel": 2, "packing": False}, "hf.sequence_parallel"),
    (2, {"sequence_parallel": 2, "attn_implementation": "eager"}, "hf.sequence_parallel"),
])
def test_bad_sharding_is_one_line_naming_the_field(world, hf, field):
    data = {"backend": "hf", "hf": hf, "run": {"launcher": "ray", "world_size": world}}
    with pytest.raises(ConfigError) as e:
        build_config(TrainerConfig, data, "train.yaml")
    msg = str(e.value)
    assert "\n" not in msg and field in msg, msg


def test_expert_parallel_is_refused_for_the_hf_backend():
    with pytest.raises(ValidationError, match="model.expert_parallel"):
        TrainerConfig(backend="hf", model={"expert_parallel": 2},
                      run={"launcher": "ray", "world_size": 2})


def test_sequence_parallel_heads_must_split():
    from types import SimpleNamespace

    from trainer.hf.ulysses import check_heads

    check_heads(SimpleNamespace(num_attention_heads=32, num_key_value_heads=4), 4)
    # without SP every family runs as before (GPT-OSS: sliding windows)
    check_heads(SimpleNamespace(num_attention_heads=4, num_key_value_heads=2,
                                sliding_window=128), 1)
    with pytest.raises(ValueError, match="hf.sequence_parallel: 4 must divide"):
        check_heads(SimpleNamespace(num_attention_heads=32, num_key_value_heads=2), 4)
    with pytest.raises(ValueError, match="sliding-window"):
        check_heads(SimpleNamespace(num_attention_heads=4, num_key_value_heads=2,
                                    sliding_window=128), 2)
