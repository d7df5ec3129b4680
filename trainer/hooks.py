"""Step hooks: code a run names in its trainer config (`hooks`) that the loop consults before
every step, in the loop's process, so every rank takes the same decision for the same step.

A hook entry is `"module.path:factory"` or `{path: "module.path:factory", options: {...}}`;
the loop calls `factory(**options)` once at start and the object's `before_step(step,
policy_version)` before each step (`step`: steps taken so far, `policy_version`: the
trainer's). It returns a `StepControl`: the coming step's optimizer updates run at
lr x `lr_scale` (the ranks get the scale with their batch; the lr is restored after the step),
and `stop` ends the run there (checkpoint, export and exit as at `run.steps`). With several
hooks the scales multiply and any stop ends the run. Uses: an lr schedule the optimizer has no
knob for, a stop on a wall-clock budget, fault injection in tests (the alerting test's ppo_kl
spike is a hook under tests/support/).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import Field, field_validator, model_validator

from services.common.config import ConfigError, StrictConfig
from trainer.registry import check_dotted, load_attr

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepControl:
    """What a hook asks of the coming step."""

    lr_scale: float = 1.0
    stop: bool = False


class StepHook(Protocol):
    """A hook object (what a configured factory returns)."""

    def before_step(self, step: int, policy_version: int) -> StepControl: ...


class HookConfig(StrictConfig):
    """One `hooks` entry: the factory's dotted path and its keyword arguments."""

    path: str = Field(description="module.path:factory, importable in the trainer's process")
    options: dict[str, Any] = Field(default_factory=dict, description="factory(**options)")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data: Any) -> Any:
        return {"path": data} if isinstance(data, str) else data

    @field_validator("path")
    @classmethod
    def _dotted(cls, path: str) -> str:
        check_dotted(path, "")
        return path


def load_hooks(specs: Sequence[HookConfig]) -> list[StepHook]:
    """Every configured hook, built (ConfigError naming `hooks.<i>` when one cannot be)."""
    hooks = []
    for i, spec in enumerate(specs):
        try:
            factory = load_attr(spec.path, f"hooks.{i}.path")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not callable(factory):
            raise ConfigError(f"hooks.{i}.path: {spec.path!r} is not callable")
        try:
            hook = factory(**spec.options)
        except TypeError as e:
            raise ConfigError(f"hooks.{i}.options: {spec.path}: {e}") from None
        if not callable(getattr(hook, "before_step", None)):
            raise ConfigError(f"hooks.{i}.path: {spec.path!r} returned {type(hook).__name__}, "
                              f"which has no before_step(step, policy_version)")
        hooks.append(hook)
    return hooks


def before_step(hooks: Sequence[StepHook], step: int, policy_version: int) -> StepControl:
    """Every hook's decision for the coming step, combined."""
    scale, stop = 1.0, False
    for hook in hooks:
        got = hook.before_step(step, policy_version)
        if got.lr_scale <= 0:
            raise ValueError(f"{type(hook).__name__}.before_step: lr_scale {got.lr_scale} <= 0")
        scale, stop = scale * got.lr_scale, stop or got.stop
    return StepControl(lr_scale=scale, stop=stop)
