"""Reward functions ("verifiers") and how they are called.

Built-ins are looked up by name (`exact_match`, `numeric`, `math`, `format`); anything else is an
import path `pkg.mod:fn`. A user function is called in one of two shapes, told apart by its
parameter names once, at load:

- r3flow: `fn(response, answer, *, prompt=, extra=, data_source=, prompt_id=)`: the first two
  positionally, each keyword only if the function names it (or takes `**kwargs`);
- verl: a function with a `solution_str` parameter gets verl's `compute_score` keywords
  (`data_source`, `solution_str`, `ground_truth`, `extra_info`), so a verl reward file runs as is.

It returns a float, or a dict with `score` and further numeric entries (sent as the
trajectory's reward components), and may be `async def`.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.rollout.config import RewardConfig
from services.rollout.math_grader import math_reward

Verifier = Callable[[str, str], float]

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_CONTEXT = ("prompt", "extra", "data_source", "prompt_id")
DEFAULT_FORMAT: str = RewardConfig.model_fields["format_pattern"].default


@dataclass(frozen=True)
class RewardInput:
    """What a reward sees of one sample: its prompt (the rendered text), response, ground
    truth, and the row's source and extra fields."""

    response: str
    ground_truth: str
    prompt: str = ""
    prompt_id: str = ""
    data_source: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def keywords(self) -> dict[str, Any]:
        """The context keywords of the r3flow call shape."""
        return {"prompt": self.prompt, "extra": dict(self.extra),
                "data_source": self.data_source, "prompt_id": self.prompt_id}

    def verl_keywords(self) -> dict[str, Any]:
        """verl's `compute_score` keywords (extra_info: the row's `extra_info`, else extras)."""
        extra_info = self.extra.get("extra_info", dict(self.extra))
        return {"data_source": self.data_source, "solution_str": self.response,
                "ground_truth": self.ground_truth, "extra_info": extra_info}


@dataclass(frozen=True)
class RewardFn:
    """A verifier bound to its call shape; `call(sample)` returns its raw result (a float or
    dict, or an awaitable of one when `is_async`)."""

    name: str
    call: Callable[[RewardInput], Any]
    is_async: bool


def exact_match(response: str, answer: str) -> float:
    """1.0 when the stripped response equals the stripped answer."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def last_number(text: str) -> float | None:
    """The last number written in `text` (commas as thousands separators allowed), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def numeric(response: str, answer: str, rel_tol: float = 1e-6) -> float:
    """1.0 when the last number in the response equals the answer's number."""
    got, want = last_number(response), last_number(answer)
    if got is None or want is None:
        return 0.0
    return 1.0 if math.isclose(got, want, rel_tol=rel_tol, abs_tol=rel_tol) else 0.0


def format_check(pattern: str) -> Verifier:
    """A verifier scoring 1.0 when the response contains a match of `pattern`."""
    compiled = re.compile(pattern, re.DOTALL)

    def format_reward(response: str, answer: str) -> float:
        return 1.0 if compiled.search(response) else 0.0
    return format_reward


BUILTIN: dict[str, Verifier] = {"exact_match": exact_match, "numeric": numeric,
                                "math": math_reward, "format": format_check(DEFAULT_FORMAT)}


def bind(name: str, fn: Callable[..., Any]) -> RewardFn:
    """`fn` with its call shape (r3flow or verl) decided once from its parameters."""
    try:
        params: Mapping[str, inspect.Parameter] = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}  # a builtin without a signature: the plain (response, answer) shape
    any_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        type(fn).__call__)  # an object with an `async def __call__`
    if "solution_str" in params:
        names = [k for k in ("data_source", "solution_str", "ground_truth", "extra_info")
                 if any_kw or k in params]
        _check_binds(name, params, (), names)
        return RewardFn(name, lambda s: fn(**{k: s.verl_keywords()[k] for k in names}),
                        is_async)
    wanted = [k for k in _CONTEXT if any_kw or k in params]
    _check_binds(name, params, ("response", "answer"), wanted)
    if not wanted:
        return RewardFn(name, lambda s: fn(s.response, s.ground_truth), is_async)
    return RewardFn(name, lambda s: fn(s.response, s.ground_truth,
                                       **{k: s.keywords()[k] for k in wanted}), is_async)


def _check_binds(name: str, params: Mapping[str, inspect.Parameter], args: tuple[str, ...],
                 keywords: list[str]) -> None:
    """ValueError at load (not a fallback per sample) when `fn` cannot take its call shape."""
    if not params:
        return
    try:
        inspect.Signature(list(params.values())).bind(*args, **dict.fromkeys(keywords))
    except TypeError as e:
        raise ValueError(f"verifier: {name!r} cannot be called as fn(response, answer, "
                         f"*, {', '.join(_CONTEXT)}) or verl's compute_score(data_source, "
                         f"solution_str, ground_truth, extra_info): {e}") from None


def resolve_verifier(name: str, builtin: Mapping[str, Verifier] = BUILTIN) -> RewardFn:
    """A built-in verifier by name or a user one by `pkg.mod:fn`; ValueError names the field."""
    if name in builtin:
        return bind(name, builtin[name])
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"verifier: unknown verifier {name!r} "
                         f"(built-in: {sorted(builtin)}, or an import path `pkg.mod:fn`)")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"verifier: cannot load {name!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"verifier: {name!r} is not callable")
    return bind(name, fn)


class VerifierRegistry:
    """Resolves verifier names once and remembers them (one registry per worker); `format`
    searches for `format_pattern`; `bound` adds verifiers already bound (`remote`)."""

    def __init__(self, format_pattern: str = DEFAULT_FORMAT,
                 bound: Mapping[str, RewardFn] | None = None) -> None:
        self._builtin = {**BUILTIN, "format": format_check(format_pattern)}
        self._cache: dict[str, RewardFn] = dict(bound or {})

    def get(self, name: str) -> RewardFn:
        if name not in self._cache:
            self._cache[name] = resolve_verifier(name, self._builtin)
        return self._cache[name]

    async def aclose(self) -> None:
        """Close what verifiers hold open (the remote verifier's HTTP session); a later call
        opens it again."""
        for fn in self._cache.values():
            close = getattr(fn.call, "close", None)
            if close is not None and inspect.iscoroutinefunction(close):
                await close()
