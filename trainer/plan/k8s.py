"""The part of a Kubernetes manifest the planner reads, typed: a document that is not a
Kubernetes object, or a RayJob missing a field the planner needs, is a `UserError` naming the
document and the field (dotted path), never a KeyError from deep inside the planner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.config import YAML_LOADER
from services.common.errors import UserError, syntax_error


class _Loose(BaseModel):
    """Kubernetes objects carry far more than the planner reads: other fields are ignored."""

    model_config = ConfigDict(extra="ignore")


class Metadata(_Loose):
    name: str
    annotations: dict[str, str] = Field(default_factory=dict)


class Resources(_Loose):
    limits: dict[str, str | int | float] = Field(default_factory=dict)


class Container(_Loose):
    resources: Resources = Field(default_factory=Resources)

    def limit(self, key: str) -> Any:
        return self.resources.limits.get(key)


class ConfigMapRef(_Loose):
    name: str


class Volume(_Loose):
    name: str
    configMap: ConfigMapRef | None = None  # noqa: N815 (Kubernetes' spelling)


class PodSpec(_Loose):
    containers: list[Container] = Field(min_length=1)
    volumes: list[Volume] = Field(default_factory=list)


class PodTemplate(_Loose):
    spec: PodSpec


class PodGroup(_Loose):
    replicas: int = Field(1, ge=0)
    template: PodTemplate


class RayClusterSpec(_Loose):
    headGroupSpec: PodGroup  # noqa: N815
    workerGroupSpecs: list[PodGroup] = Field(default_factory=list)  # noqa: N815


class RayJobSpec(_Loose):
    rayClusterSpec: RayClusterSpec  # noqa: N815


class RayJob(_Loose):
    metadata: Metadata
    spec: RayJobSpec


class ConfigMap(_Loose):
    metadata: Metadata
    data: dict[str, str] = Field(default_factory=dict)


def read_documents(path: str | Path) -> list[dict]:
    """The Kubernetes objects of a (multi-document) YAML file; UserError names the file, and
    the line and column of a syntax error or the document that is not a Kubernetes object."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text (a manifest is YAML)") from None
    except OSError as e:
        raise UserError(f"{path}: {e.strerror}") from None
    try:
        docs = [d for d in yaml.load_all(text, Loader=YAML_LOADER) if d is not None]
    except yaml.YAMLError as e:
        raise syntax_error(path, e) from None
    for i, d in enumerate(docs, 1):
        if not (isinstance(d, dict) and isinstance(d.get("kind"), str)
                and isinstance(d.get("apiVersion"), str)):
            raise UserError(f"{path}: document {i} is not a Kubernetes object (a mapping with "
                            f"apiVersion and kind), got {_short(d)}")
    return docs


def parse(cls: type[_Loose], doc: dict, where: str) -> Any:
    """`doc` as `cls`; UserError `WHERE: field.path: problem`."""
    try:
        return cls.model_validate(doc)
    except ValidationError as e:
        raise UserError("; ".join(f"{where}: {'.'.join(str(p) for p in err['loc'])}: "
                                  f"{err['msg']}" for err in e.errors())) from None


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
