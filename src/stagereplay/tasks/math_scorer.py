"""The `math` scorer: the model's final answer and the gold answer parsed as LaTeX math and compared as math.

Reasoning models (R1-Distill, QwQ, Qwen3) end with `\\boxed{...}`, often in LaTeX (`\\frac{1}{2}`,
`\\sqrt{3}`, `x = 5`, `\\text{(B)}`), where the last number of the text is the wrong answer. This scorer
reads, as published evaluations of these models do, through Hugging Face's `math-verify`:

- the output's answer is its last `\\boxed{}` (or `\\fbox{}`), braces balanced; with no box, its last
  non-empty line (`Answer: 307`);
- the gold answer is read as if it were boxed, so `\\frac12`, `0.5`, `[1, 3)`, `B`, `5\\text{ cm}` all parse;
- the two are equal when `math_verify.verify(gold, answer)` says so (fractions, radicals, intervals, sets,
  percentages, units dropped, multiple-choice letters).

`math_answer` is the answer's parsed form as one string (floats made exact, the simplified sympy expression,
`x = 5` read as `5`), so that `resample` counts `0.5` and `\\frac{1}{2}` as one answer.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from importlib import metadata
from typing import Any

from stagereplay.errors import StageReplayError

PACKAGE = "math-verify"
BOXES = ("\\boxed", "\\fbox")
MISSING_FIX = "pip install 'math-verify>=0.7' (a dependency of stagereplay)"


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError:
        raise StageReplayError(f"--scorer math needs the {PACKAGE} package, which is not installed",
                               MISSING_FIX) from None
    return math_verify


def check_available() -> None:
    """Fail up front, before any run directory exists, when `math-verify` is missing."""
    _math_verify()


def scorer_packages() -> dict[str, str | None]:
    """The versions that decide this scorer's labels, for the manifest."""
    out: dict[str, str | None] = {}
    for name in (PACKAGE, "latex2sympy2_extended", "sympy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced; None if none closes."""
    start = max(text.rfind(box + "{") for box in BOXES)
    while start >= 0:
        open_at = text.index("{", start)
        depth = 0
        for i in range(open_at, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[open_at + 1 : i]
        start = max(text.rfind(box + "{", 0, start) for box in BOXES)  # unclosed: try the box before it
    return None


def final_answer_text(output: str) -> str | None:
    """What the answer is read from: the last box's content, boxed again, or else the last non-empty line."""
    boxed = last_boxed(output)
    if boxed is not None:
        return "\\boxed{" + boxed + "}"
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else None


def _timeouts() -> dict[str, Any]:
    # math-verify bounds its sympy work with SIGALRM, which only the main thread may set; elsewhere (a Ray
    # actor's thread) it runs unbounded rather than failing.
    main = threading.current_thread() is threading.main_thread()
    return {"parsing_timeout": 5 if main else None}


def parse_answer(output: str) -> list[Any]:
    """The output's final answer as math-verify parses it ([] when there is none)."""
    text = final_answer_text(output)
    if text is None:
        return []
    result: list[Any] = _math_verify().parse(text, **_timeouts())
    return result


@lru_cache(maxsize=4096)
def parse_gold(answer: str) -> list[Any]:
    """A gold answer, read as if boxed (`0.5`, `\\frac12`, `[1, 3)`, `B`)."""
    answer = answer.strip()
    if not answer:
        return []
    text = answer if last_boxed(answer) is not None else "\\boxed{" + answer + "}"
    result: list[Any] = _math_verify().parse(text, **_timeouts())
    return result


def math_match(output: str, answer: str) -> bool:
    """The output's final answer equals the gold answer as math."""
    gold, got = parse_gold(answer), parse_answer(output)
    if not gold or not got:
        return False
    main = threading.current_thread() is threading.main_thread()
    return bool(_math_verify().verify(gold, got, timeout_seconds=5 if main else None))


def canonical(parsed: list[Any]) -> str | None:
    """One string per mathematical value: floats made exact (`0.5` -> `1/2`), `x = 5` -> `5`, then simplified."""
    if not parsed:
        return None
    import sympy

    expr = parsed[0]
    if isinstance(expr, str):
        return expr.strip()
    if isinstance(expr, sympy.Eq) and isinstance(expr.lhs, sympy.Symbol):
        expr = expr.rhs
    try:
        expr = expr.xreplace({f: sympy.Rational(str(f)) for f in expr.atoms(sympy.Float)})
        if isinstance(expr, sympy.Expr):
            expr = sympy.simplify(expr)
    except Exception:  # a set, tuple or matrix that sympy will not simplify stays as parsed
        pass
    return str(expr)


def math_answer(output: str) -> str | None:
    """The output's final answer in its parsed form (None: no answer found)."""
    return canonical(parse_answer(output))
