"""Math answer equivalence for the `math` verifier: the final answer of a response (its last
`\\boxed{}`, else 'the answer is X', else its last number) against the ground truth, compared by
the math-verify package (`math_verify.parse` + `verify`: LaTeX and plain expressions, numbers,
`\\frac12` = `0.5`, `2\\sqrt{2}` = `\\sqrt{8}`, `x^2+2x+1` = `(x+1)^2`, tuples, intervals, sets).

math-verify's own timeouts use SIGALRM, which works only on a process's main thread; rewards run
on worker threads (services/rollout/rewards.py), so they are off here and the runner's
`reward.timeout_s` bounds a call instead (its per-call warning that says so is silenced).
"""

from __future__ import annotations

import logging
import math
import re

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

_BOXED = ("\\boxed", "\\fbox")
_ANSWER_IS = re.compile(r"answer is[:\s]*\$?([^\n$]+?)\$?\s*\.?\s*$", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_EXTRACT = (LatexExtractionConfig(), ExprExtractionConfig())


class _NoTimeoutNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify", "math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).addFilter(_NoTimeoutNotice())


def last_boxed(text: str) -> str | None:
    """Contents of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced."""
    start = max(text.rfind(tag) for tag in _BOXED)
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1:i]
    return None


def final_answer(text: str) -> str | None:
    """A response's final answer: its last box, else 'the answer is X', else its last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    tail = text.strip().splitlines()[-1] if text.strip() else ""
    m = _ANSWER_IS.search(tail)
    if m:
        return m.group(1)
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


def _parsed(answer: str) -> list[object]:
    """math-verify's reading of one final answer (given without `$`: it is wrapped in one)."""
    return parse(f"${answer}$", extraction_config=list(_EXTRACT), parsing_timeout=None)


def _number(s: str) -> float | None:
    try:
        return float(s.replace(",", "")) if _NUMBER.fullmatch(s.strip().replace(",", "")) else None
    except ValueError:
        return None


def answers_equal(got: str, want: str) -> bool:
    """Whether two final answers are the same value (as strings, else by math-verify)."""
    if got.strip() == want.strip():
        return True
    a, b = _number(got), _number(want)
    if a is not None and b is not None:  # plain numbers (most graded answers): no parse needed
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    g, w = _parsed(got), _parsed(want)
    return bool(g and w and verify(w, g, timeout_seconds=None))


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the ground truth (boxed or not)."""
    got = final_answer(response)
    if got is None:
        return 0.0
    want = last_boxed(answer)
    return 1.0 if answers_equal(got, want if want is not None else answer) else 0.0
