"""Typed configuration: every component owns a pydantic model; files are TOML or YAML.

Loading validates at boot and raises `ConfigError` whose message names the offending key
(dotted path), so a typo'd or mistyped field never starts a half-configured process.
"""

from __future__ import annotations

import json
import logging
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from services.common.errors import UserError, syntax_error

log = logging.getLogger(__name__)

C = TypeVar("C", bound="StrictConfig")
# libyaml's loader where PyYAML was built with it (the wheels are): ~10x faster, same marks.
YAML_LOADER: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ConfigError(UserError):
    """A configuration file or override is invalid; the message names the key (a user's mistake:
    `r3flow <command>: <message>`, exit 2)."""


class StrictConfig(BaseModel):
    """Base for component configs: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


def multiple_of(n: int, why: str) -> AfterValidator:
    """An int field's check (`Annotated[int, multiple_of(32, why)]`, after its Field bounds):
    a multiple of `n`; the error says `why` (what needs it)."""

    def check(v: int) -> int:
        if v % n:
            raise ValueError(f"must be a multiple of {n} ({why})")
        return v

    return AfterValidator(check)


def describe(err: ValidationError, source: str = "", section: str = "") -> str:
    """`err` as `source: key: what` per bad key, `; `-joined, each key under `section` (a
    dotted path; "" = the root). A model-level check names its keys itself: no `<root>`."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in (section, *e["loc"]) if p != "")
        kind = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix(
            "Value error, ")
        lines.append(": ".join(p for p in (source, key, kind) if p))
    return "; ".join(lines)


def deep_merge(*layers: dict[str, Any]) -> dict[str, Any]:
    """The layers' mappings merged key by key, later layers winning (lists are replaced)."""
    out: dict[str, Any] = {}
    for layer in layers:
        for k, v in layer.items():
            if isinstance(v, dict):
                v = deep_merge(out[k] if isinstance(out.get(k), dict) else {}, v)
            out[k] = v
    return out


def read_mapping(path: str | Path) -> dict[str, Any]:
    """Parse a TOML/YAML/JSON file into a dict (ConfigError on syntax errors)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{p}: is a directory, not a config file")
    if not p.is_file():
        raise ConfigError(f"config file not found: {str(p)!r}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text: {e}") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror}") from None
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(text)
        elif p.suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=YAML_LOADER) or {}  # noqa: S506 (a safe loader)
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"{p}: unsupported config format {p.suffix!r} (use .toml, .yaml or .json)")
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as e:
        raise ConfigError(str(syntax_error(p, e))) from e
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping, got {type(data).__name__}")
    return data


def build_config(cls: type[C], data: dict[str, Any], source: str = "config") -> C:
    """Validate `data` against `cls`; ConfigError naming every bad key."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(describe(e, source)) from None


def load_config(cls: type[C], path: str | Path | None, overrides: dict[str, Any] | None = None) -> C:
    """Load `cls` from an optional file plus dotted-key overrides, validate, log it once."""
    data: dict[str, Any] = read_mapping(path) if path else {}
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted}: {part} is not a section")
        node[leaf] = value
    cfg = build_config(cls, data, source=str(path) if path else "config")
    log.info("resolved %s: %s", cls.__name__, cfg.model_dump_json())
    return cfg
