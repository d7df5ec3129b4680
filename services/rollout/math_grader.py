"""Math answer equivalence for the `math` verifier: the final answer of a response (its last
`\\boxed{}`, else its last number) against the ground truth, equal as strings after LaTeX
normalisation, as numbers, or as SymPy expressions (`\\frac12` = `0.5` = `1/2`, `2\\sqrt{2}` =
`\\sqrt{8}`, `x^2+2x+1` = `(x+1)^2`, tuples element by element).

Built on SymPy's LaTeX parser (its `lark` backend, no ANTLR). The math-verify package
(`math-verify==0.9.0`) covers more notation (sets, intervals, units); it is not a dependency.
"""

from __future__ import annotations

import math
import re
from typing import Any

_BOXED = ("\\boxed", "\\fbox")
_ANSWER_IS = re.compile(r"answer is[:\s]*\$?([^\n$]+?)\$?\s*\.?\s*$", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
# Spelling that does not change the value: sizing, spacing, text wrappers, degree signs, `$`.
_DROP = [r"\\left", r"\\right", r"\\!", r"\\,", r"\\;", r"\\:", r"\\quad", r"\\displaystyle",
         r"\^\{?\\circ\}?", r"\\%", r"%", r"\$", r"\\mathrm\{\s*\}", r"\s+"]
_RENAME = {"\\dfrac": "\\frac", "\\tfrac": "\\frac", "\\le": "\\leq", "\\ge": "\\geq",
           "\\cdot": "*", "\\times": "*", "\\pi": "\\pi "}


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


def normalize(expr: str) -> str:
    """A canonical spelling of a LaTeX answer (text wrappers off, `\\dfrac` as `\\frac`, ...)."""
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", expr.strip())
    for old, new in _RENAME.items():
        s = s.replace(old, new)
    for pattern in _DROP:
        s = re.sub(pattern, "", s)
    s = s.rstrip(".")
    if re.fullmatch(r"[-+]?[\d,]+(?:\.\d+)?", s):
        s = s.replace(",", "")  # thousands separators of a plain number
    return s


def _split_top(s: str) -> list[str]:
    """`s` split at commas outside brackets ("(1,2)" stays whole inside, "1,2" splits)."""
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        s = s[1:-1]
    parts, depth, cur = [], 0, ""
    for ch in s:
        depth += 1 if ch in "({[" else -1 if ch in ")}]" else 0
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def _braced(s: str, i: int) -> tuple[str, int]:
    """The group starting at s[i] (`{...}` balanced, or one character) and the index after."""
    if i < len(s) and s[i] == "{":
        depth = 0
        for j in range(i, len(s)):
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            if depth == 0:
                return s[i + 1:j], j + 1
        raise ValueError("unbalanced braces")
    return s[i:i + 1], i + 1


def latex_to_plain(s: str) -> str:
    """Common LaTeX (`\\frac`, `\\sqrt`, `^{}`, `\\pi`, functions) in SymPy's plain syntax;
    the fast path before SymPy's own LaTeX parser (which takes up to seconds per answer)."""
    out, i = [], 0
    while i < len(s):
        if s.startswith("\\frac", i):
            num, i = _braced(s, i + 5)
            den, i = _braced(s, i)
            out.append(f"(({latex_to_plain(num)})/({latex_to_plain(den)}))")
        elif s.startswith("\\sqrt", i):
            root, i = ("2", i + 5) if not s.startswith("[", i + 5) else \
                (s[i + 6:s.index("]", i)], s.index("]", i) + 1)
            arg, i = _braced(s, i)
            out.append(f"(({latex_to_plain(arg)})**(1/({root})))")
        elif s[i] == "\\":
            m = re.match(r"\\([a-zA-Z]+)", s[i:])
            name = m.group(1) if m else ""
            out.append(f" {name} ")
            i += 1 + len(name)
        else:
            out.append({"{": "(", "}": ")", "^": "**"}.get(s[i], s[i]))
            i += 1
    return "".join(out)


def _to_sympy(s: str) -> Any:
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    rules = (*standard_transformations, implicit_multiplication_application, convert_xor)
    try:
        return parse_expr(latex_to_plain(s), transformations=rules, evaluate=True)
    except Exception:  # notation the fast path does not know: SymPy's LaTeX grammar
        from sympy.parsing.latex import parse_latex
        return parse_latex(s, backend="lark")


def _number(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def _equal_one(got: str, want: str) -> bool:
    if got == want:
        return True
    a, b = _number(got), _number(want)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    try:
        import sympy

        x, y = _to_sympy(got), _to_sympy(want)
        if sympy.simplify(x - y) == 0:
            return True
        fx, fy = complex(sympy.N(x)), complex(sympy.N(y))
        return abs(fx - fy) <= 1e-9 * max(1.0, abs(fy))
    except Exception:  # unparsable or symbolic (no numeric value): not equal
        return False


def answers_equal(got: str, want: str) -> bool:
    """Whether two final answers are the same value (normalised string, number or SymPy)."""
    g, w = normalize(got), normalize(want)
    if g == w:
        return True
    gs, ws = _split_top(g), _split_top(w)
    if len(gs) != len(ws):
        return False
    return all(_equal_one(a, b) for a, b in zip(gs, ws, strict=True))


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the ground truth (boxed or not)."""
    got = final_answer(response)
    if got is None:
        return 0.0
    want = last_boxed(answer)
    return 1.0 if answers_equal(got, want if want is not None else answer) else 0.0
