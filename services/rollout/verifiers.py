"""Reward functions ("verifiers"): `fn(response_text, answer) -> float`.

Built-ins are looked up by name; anything else is an import path `pkg.mod:fn`, so users plug
their own verifier without touching this module.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable

Verifier = Callable[[str, str], float]

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


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


BUILTIN: dict[str, Verifier] = {"exact_match": exact_match, "numeric": numeric}


def resolve_verifier(name: str) -> Verifier:
    """A built-in verifier by name or a user one by `pkg.mod:fn`; ValueError names the field."""
    if name in BUILTIN:
        return BUILTIN[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"verifier: unknown verifier {name!r} "
                         f"(built-in: {sorted(BUILTIN)}, or an import path `pkg.mod:fn`)")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"verifier: cannot load {name!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"verifier: {name!r} is not callable")
    return fn


class VerifierRegistry:
    """Resolves verifier names once and remembers them (one registry per worker)."""

    def __init__(self) -> None:
        self._cache: dict[str, Verifier] = {}

    def get(self, name: str) -> Verifier:
        if name not in self._cache:
            self._cache[name] = resolve_verifier(name)
        return self._cache[name]
