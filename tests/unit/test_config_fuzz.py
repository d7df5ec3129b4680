"""Fuzz the config loader: bad TOML/YAML, unknown keys and wrong types for every component config.

Each must end in `ConfigError` whose message names the offending key (dotted path); no other
exception type may escape `load_config`, whatever the file holds.
"""

from __future__ import annotations

import inspect
import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from services.common.auth import AuthConfig, ClientAuthConfig
from services.common.config import ConfigError, build_config, load_config
from services.common.tiny_moe import TinyMoeConfig
from services.local.config import LocalConfig
from services.local.warm_start import WarmStartConfig
from services.rollout.config import RolloutConfig
from services.store.config import StoreConfig
from trainer.config import TrainerConfig

# Each config with the smallest mapping that validates.
CONFIGS: dict[str, tuple[type[BaseModel], dict[str, Any]]] = {
    "store": (StoreConfig, {}),
    "rollout": (RolloutConfig, {"engine": {"model": "m"}, "dataset": "d.jsonl",
                                "eval": {"sets": [{"name": "a", "dataset": "e.jsonl"}]}}),
    "trainer": (TrainerConfig, {}),
    "local": (LocalConfig, {}),
    "warm_start": (WarmStartConfig, {}),
    "tiny_moe": (TinyMoeConfig, {}),
    "auth": (AuthConfig, {}),
    "store_auth": (ClientAuthConfig, {}),
}
JUNK: list[Any] = [{"zz": 1}, [1, 2], "zz-not-valid", -7]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def _submodel(annotation: Any) -> type[BaseModel] | None:
    candidates = [annotation]
    if get_origin(annotation) in (Union, types.UnionType):
        candidates = list(get_args(annotation))
    for c in candidates:
        if inspect.isclass(c) and issubclass(c, BaseModel):
            return c
    return None


def leaf_paths(cls: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every leaf field of `cls` as a key path (nested configs are walked)."""
    for name, field in cls.model_fields.items():
        sub = _submodel(field.annotation)
        if sub is not None:
            yield from leaf_paths(sub, (*prefix, name))
        else:
            yield (*prefix, name)


def section_paths(cls: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The root and every nested config section, as key paths."""
    yield prefix
    for name, field in cls.model_fields.items():
        sub = _submodel(field.annotation)
        if sub is not None:
            yield from section_paths(sub, (*prefix, name))


def with_value(base: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    data = json.loads(json.dumps(base))
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    return data


def names_key(path: tuple[str, ...], message: str) -> bool:
    """The dotted key is in the message; a cross-field check may instead name the section and,
    in its own words, the field (`auth: tls_cert_file, tls_key_file: set both or neither`)."""
    return ".".join(path) in message or (path[-1] in message and ".".join(path[:-1]) in message)


CASES = [(name, path) for name, (cls, _) in CONFIGS.items() for path in leaf_paths(cls)]


@pytest.mark.parametrize("name", CONFIGS)
def test_base_mappings_validate(name: str) -> None:
    cls, base = CONFIGS[name]
    build_config(cls, base)


@pytest.mark.parametrize("name, path", CASES, ids=[f"{n}:{'.'.join(p)}" for n, p in CASES])
def test_wrong_type_names_the_key(name: str, path: tuple[str, ...]) -> None:
    cls, base = CONFIGS[name]
    key = ".".join(path)
    refused = 0
    for junk in JUNK:
        try:
            build_config(cls, with_value(base, path, junk))
        except ConfigError as e:
            refused += 1
            assert names_key(path, str(e)), (junk, str(e))
    assert refused >= 1, f"{key}: accepts every junk value {JUNK}"


@pytest.mark.parametrize("name", CONFIGS)
def test_unknown_key_in_every_section_is_named(name: str) -> None:
    cls, base = CONFIGS[name]
    for section in section_paths(cls):
        path = (*section, "zz_typo")
        with pytest.raises(ConfigError) as err:
            build_config(cls, with_value(base, path, 1))
        assert f"{'.'.join(path)}: unknown key" in str(err.value)


def _load(tmp_path: Path, suffix: str, data: bytes, cls: type[BaseModel]) -> None:
    p = tmp_path / f"cfg{suffix}"
    p.write_bytes(data)
    try:
        load_config(cls, p)
    except ConfigError:
        pass


@FUZZ
@given(text=st.text(max_size=300), suffix=st.sampled_from([".toml", ".yaml", ".json"]),
       name=st.sampled_from(list(CONFIGS)))
def test_garbage_files_raise_only_config_error(tmp_path_factory, text: str, suffix: str,  # noqa: ANN001
                                               name: str) -> None:
    _load(tmp_path_factory.mktemp("g"), suffix, text.encode(), CONFIGS[name][0])


def test_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    p = tmp_path / "cfg.toml"
    p.write_bytes(b"listen = \"\xff\xfe\"\n")
    with pytest.raises(ConfigError, match="cfg.toml: not UTF-8"):
        load_config(StoreConfig, p)


scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20),
                    st.lists(st.integers(), max_size=3))
values = st.recursive(scalars, lambda c: st.dictionaries(st.text(max_size=8), c, max_size=3),
                      max_leaves=8)


@FUZZ
@given(name=st.sampled_from(list(CONFIGS)), data=st.data(), value=values,
       fmt=st.sampled_from(["yaml", "json"]))
def test_random_values_in_files_are_validated(tmp_path_factory, name: str, data, value: Any,  # noqa: ANN001
                                              fmt: str) -> None:
    """A random value at a random key, through a real file: it validates, or ConfigError names
    that key (or a key below it)."""
    cls, base = CONFIGS[name]
    path = data.draw(st.sampled_from([p for n, p in CASES if n == name]))
    mapping = with_value(base, path, value)
    p = tmp_path_factory.mktemp("v") / f"cfg.{fmt}"
    p.write_text(yaml.safe_dump(mapping) if fmt == "yaml" else json.dumps(mapping))
    try:
        load_config(cls, p)
    except ConfigError as e:
        assert names_key(path, str(e)), str(e)
