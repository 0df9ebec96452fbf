"""Answer checkers, chosen by name: how a domain finds the final answer in a completion and compares it.

A `Checker` is three pure functions: `extract(completion) -> str | None` (the final answer),
`equal(predicted, reference) -> bool`, and `parse_reference(value) -> str`, which canonicalises a
dataset's answer and raises ValueError when it cannot. `numeric` reads numbers, `exact` compares
strings, `math` decides equivalence with `math_verify` (MATH's `\\boxed{}` answers).

Every checker reads a final `#### <answer>` line, so `#### <answer>\\n` is a minimal gold solution
for all of them. Each `Checker.verify` is a pure verifier, also by dotted path
(`components.domains.checkers:verify_numeric`).

    >>> c = get_checker("numeric")
    >>> c.extract("13*2 = 26 eggs.\\nA: $26"), c.parse_reference(" 1,200 ")
    ('26', '1200')
    >>> c.verify(["#### 26.0", "A: 25"], ["26", "26"])
    [1.0, 0.0]
    >>> verify_math(["so $\\\\boxed{\\\\frac{2}{4}}$", "#### 0.5", "#### 1/3"], ["\\\\frac{1}{2}"] * 3)
    [1.0, 1.0, 0.0]
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from components.domains.base import verify_answers

# A minus sign counts only when no digit precedes it, so "16-3" yields 16 and 3, not -3.
_NUMBER = re.compile(r"(?<!\d)-?(?:\d(?:[\d,]*\d)?(?:\.\d+)?|\.\d+)")
# Final-answer markers; the last one in the text wins. "A:" only as a word, not inside "DATA:".
_MARKER = re.compile(r"####|(?<![A-Za-z])A:|(?i:the (?:final )?answer is:?)")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_REL_TOL = 1e-6  # numeric answers compare within this relative tolerance
_ABS_TOL = 1e-9  # so that a reference of 0 still has some tolerance


@dataclass(frozen=True)
class Checker:
    name: str
    extract: Callable[[str], str | None]  # the final answer in a completion, None if there is none
    equal: Callable[[str, str], bool]  # (predicted, reference): is the prediction right?
    parse_reference: Callable[[Any], str]  # a dataset's answer -> canonical string; ValueError if unparseable

    def verify(self, completions: list[str], references: list[str]) -> list[float | None]:
        """1.0 where the extracted answer equals the reference, else 0.0 (never None)."""
        if None in references:
            raise ValueError(f"{self.name}.verify: a reference is None; every problem has an answer")
        return verify_answers(self.name, completions, references, self.extract, self.equal)


# -- shared extraction helpers ---------------------------------------------------------------------

def last_boxed(text: str) -> tuple[int, str] | None:
    """(start, content) of the last `\\boxed{...}`, braces balanced; None if there is none or it is unclosed.

    >>> last_boxed(r"so $\\boxed{\\frac{1}{2}}$."), last_boxed("none")
    ((4, '\\\\frac{1}{2}'), None)
    """
    matches = list(_BOXED.finditer(text))
    for m in reversed(matches):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return m.start(), text[m.end():i - 1].strip()
    return None


def _last_marker(text: str) -> tuple[int, str] | None:
    """(position, what follows) for the last final-answer marker: '####', 'A:', 'The answer is' or a box."""
    found = [(m.start(), text[m.end():]) for m in _MARKER.finditer(text)]
    boxed = last_boxed(text)
    if boxed:
        found.append(boxed)
    return max(found, key=lambda f: f[0]) if found else None


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip() if text.strip() else ""


def _clip(value: Any, n: int = 120) -> str:
    s = repr(value)
    return s if len(s) <= n else s[:n] + "…"


# -- numeric ---------------------------------------------------------------------------------------

def numeric_extract(completion: str) -> str | None:
    """The number after the last final-answer marker, commas removed; else the last number in the text.

    >>> [numeric_extract(t) for t in ["x\\n#### $1,200.50", "A: 18", "The answer is -3.", r"$\\boxed{7}$", "16-3", "no"]]
    ['1200.50', '18', '-3', '7', '3', None]
    """
    marked = _last_marker(completion)
    if marked:
        m = _NUMBER.search(marked[1])
        if m:
            return m[0].replace(",", "")
    numbers = _NUMBER.findall(completion)
    return numbers[-1].replace(",", "") if numbers else None


def _to_float(text: str) -> float | None:
    try:
        x = float(text.replace(",", "").strip())
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def numeric_equal(predicted: str, reference: str) -> bool:
    """Numerically equal within a relative 1e-6: '18' == '18.0', '1,200' == '1200'.

    >>> numeric_equal("18", "18.0"), numeric_equal("1,200", "1200"), numeric_equal("18.01", "18"), numeric_equal("x", "1")
    (True, True, False, False)
    """
    a, b = _to_float(predicted), _to_float(reference)
    return a is not None and b is not None and math.isclose(a, b, rel_tol=_REL_TOL, abs_tol=_ABS_TOL)


def numeric_parse_reference(value: Any) -> str:
    """A number (int, float or numeric string, commas allowed) -> its text with commas removed.

    >>> numeric_parse_reference(" 1,200 "), numeric_parse_reference(18), numeric_parse_reference("-0.5")
    ('1200', '18', '-0.5')
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a number, got {_clip(value)}")
    text = str(value).replace(",", "").strip()
    if _to_float(text) is None:
        raise ValueError(f"expected a number, got {_clip(value)}")
    return text


# -- exact -----------------------------------------------------------------------------------------

def exact_extract(completion: str) -> str | None:
    """The rest of the line after the last '####', else the last `\\boxed{}`, else the last non-empty line.

    >>> exact_extract("reasoning\\n#### Paris \\nignored"), exact_extract(r"so \\boxed{B}"), exact_extract("a\\n b \\n"), exact_extract(" ")
    ('Paris', 'B', 'b', None)
    """
    _, sep, tail = completion.rpartition("####")
    if sep:
        return _first_line(tail) or None
    boxed = last_boxed(completion)
    if boxed:
        return boxed[1]
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else None


def exact_equal(predicted: str, reference: str) -> bool:
    """Equal after stripping surrounding whitespace; case and inner spacing matter.

    >>> exact_equal(" Paris", "Paris"), exact_equal("paris", "Paris")
    (True, False)
    """
    return predicted.strip() == reference.strip()


def exact_parse_reference(value: Any) -> str:
    """Any scalar -> its stripped text; it must be one non-empty line (extract reads one line)."""
    if value is None or isinstance(value, (list, dict)):
        raise ValueError(f"expected a one-line string, got {_clip(value)}")
    text = str(value).strip()
    if not text or "\n" in text:
        raise ValueError(f"expected a non-empty one-line string, got {_clip(value)}")
    return text


# -- math ------------------------------------------------------------------------------------------

def _strip_dollars(text: str) -> str:
    text = text.strip()
    while len(text) >= 2 and text[0] == "$" and text[-1] == "$":
        text = text[1:-1].strip()
    return text


def math_extract(completion: str) -> str | None:
    """The content of the last `\\boxed{}`, or what follows the last '####' / 'The answer is' / 'A:' on its line.

    No fallback to the last line: free text rarely parses to the intended expression.

    >>> math_extract(r"Thus $x = \\boxed{\\frac{1}{2}}$."), math_extract("#### $3\\\\sqrt{2}$")
    ('\\\\frac{1}{2}', '3\\\\sqrt{2}')
    >>> math_extract("The answer is 5."), math_extract("7")
    ('5', None)
    """
    marked = _last_marker(completion)
    if marked is None:
        return None
    if _BOXED.match(completion, marked[0]):
        return marked[1] or None
    answer = _strip_dollars(_first_line(marked[1]).rstrip(".").strip())
    return answer or None


def _normal(text: str) -> str:
    return re.sub(r"\s+|\\[,;!: ]|\$", "", text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")


def _math_timeout() -> int | None:
    # math_verify times out with signal.alarm, which only works on the main thread; elsewhere it
    # would raise, so off the main thread we run without its timeout.
    return 5 if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=65536)
def _mv_parse(text: str, strict: bool) -> tuple:
    from math_verify import parse

    # Wrapped in \boxed{} so the whole string is read as LaTeX ('3\sqrt{2}' bare would parse as 3).
    got = parse(f"\\boxed{{{_strip_dollars(text)}}}", fallback_mode="no_fallback" if strict else "first_match",
                parsing_timeout=_math_timeout())
    return tuple(got)


def _sympy_parse(text: str):
    """Fallback for when math_verify is missing: a small LaTeX subset (fractions, roots, powers) to sympy."""
    import sympy
    from sympy.parsing.sympy_parser import implicit_multiplication_application, parse_expr, standard_transformations

    s = _normal(text)
    s = re.sub(r"\\(?:left|right|displaystyle)", "", s)
    for _ in range(8):  # nested fractions: innermost first
        s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
        s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\pi", "pi").replace("^", "**")
    s = s.replace("{", "(").replace("}", ")").replace("\\", "")
    try:
        return parse_expr(s, transformations=standard_transformations + (implicit_multiplication_application,),
                          local_dict={"pi": sympy.pi})
    except Exception:  # sympy raises many kinds on bad input; all mean "not parsed"
        return None


def math_equal(predicted: str, reference: str) -> bool:
    """Mathematically equivalent (math_verify; sympy if math_verify is not installed), or equal as text.

    >>> math_equal("0.5", r"\\frac{1}{2}"), math_equal(r"\\dfrac{2}{4}", r"\\frac{1}{2}"), math_equal("x^2+1", "1+x^2"), math_equal("2", "3")
    (True, True, True, False)
    """
    if _normal(predicted) == _normal(reference):
        return True
    try:
        from math_verify import verify
    except ImportError:
        a, b = _sympy_parse(predicted), _sympy_parse(reference)
        if a is None or b is None:
            return False
        try:
            return bool(abs(complex((a - b).evalf())) <= _REL_TOL * max(1.0, abs(complex(b.evalf()))))
        except (TypeError, ValueError):  # symbolic: not a number, so simplify instead
            import sympy
            return sympy.simplify(a - b) == 0
    gold, pred = _mv_parse(reference, False), _mv_parse(predicted, False)
    return bool(gold and pred and verify(list(gold), list(pred), timeout_seconds=_math_timeout()))


def math_parse_reference(value: Any) -> str:
    """A MATH answer -> its LaTeX: the last `\\boxed{}` content if any, `$` stripped; ValueError if unparseable.

    >>> math_parse_reference(r"so it is $\\boxed{\\frac{1}{2}}$."), math_parse_reference(0.5), math_parse_reference("$x^2$")
    ('\\\\frac{1}{2}', '0.5', 'x^2')
    """
    if value is None or isinstance(value, (bool, list, dict)):
        raise ValueError(f"expected a math answer, got {_clip(value)}")
    text = str(value)
    boxed = last_boxed(text)
    answer = _strip_dollars(boxed[1] if boxed else text)
    try:
        import math_verify  # noqa: F401
    except ImportError:
        ok = bool(answer) and _sympy_parse(answer) is not None
    else:
        ok = bool(answer) and bool(_mv_parse(answer, True))
    if not ok:
        raise ValueError(f"math_verify cannot parse the answer {_clip(value)}")
    return answer


CHECKERS: dict[str, Checker] = {
    "numeric": Checker("numeric", numeric_extract, numeric_equal, numeric_parse_reference),
    "exact": Checker("exact", exact_extract, exact_equal, exact_parse_reference),
    "math": Checker("math", math_extract, math_equal, math_parse_reference),
}

verify_numeric = CHECKERS["numeric"].verify
verify_exact = CHECKERS["exact"].verify
verify_math = CHECKERS["math"].verify


def get_checker(name: str) -> Checker:
    """The checker registered as `name`.

    >>> get_checker("exact").name
    'exact'
    """
    if name not in CHECKERS:
        raise ValueError(f"unknown checker {name!r}: known checkers are {sorted(CHECKERS)}")
    return CHECKERS[name]
