"""task.grader "math": equivalence by HF math-verify (LaTeX and plain expressions through sympy).

`\\frac{1}{2}` matches `0.5`, `x = 3` matches `3`, `\\boxed{3\\text{ cm}}` matches `3`, `1{,}000`
matches `1000`. math-verify's own timeouts use signal.alarm, which works only on the main thread
and cannot interrupt a long integer operation in C anyway, so they are off; the bounds below keep
every graded text small enough to be fast (a text outside them scores 0 without parsing):

- only the text from the last `\\boxed` on is graded (math-verify takes the last boxed answer
  first anyway), else the last GRADED_CHARS characters (the final answer is at the end), so
  that a power or brace in the working before the answer does not count against it;
- braces nest at most MAX_BRACE_DEPTH deep (500 nested braces take math-verify ~5 s);
- no digit run longer than MAX_DIGITS, no exponent of more than MAX_EXPONENT_DIGITS digits, no
  power inside an exponent and no factorial of a number of several digits (`2^{2^{2^{100}}}` would
  have sympy compute the number, holding the GIL for ever).
"""

from __future__ import annotations

import logging
import re
from functools import lru_cache

from shared.errors import QerlError

GRADED_CHARS = 1_000
MAX_BRACE_DEPTH = 8
MAX_DIGITS = 100
MAX_EXPONENT_DIGITS = 3

_TOO_COSTLY = re.compile(
    rf"\d{{{MAX_DIGITS + 1},}}"                         # a huge literal
    rf"|(?:\^|\*\*)\s*[{{(]?\s*-?\d{{{MAX_EXPONENT_DIGITS + 1},}}"  # 2^{12345}, 2**12345
    r"|\^\s*\{[^{}]*(?:\^|\*\*)"                     # a power inside a braced exponent
    r"|\^\s*\(?\s*[\w.]+\s*\)?\s*\^"                 # 2^2^2 chained
    r"|\*\*[^*\n]{0,40}\*\*"                         # 2**2**2 chained
    r"|\d{3,}\s*!"                                   # 123! and up
)


def within_bounds(text: str) -> bool:
    """Whether `text` is small and tame enough to hand to math-verify."""
    depth = deepest = 0
    for char in text:
        if char == "{":
            depth += 1
            deepest = max(deepest, depth)
        elif char == "}":
            depth = max(0, depth - 1)
    return deepest <= MAX_BRACE_DEPTH and not _TOO_COSTLY.search(text)


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise QerlError("task.grader math needs the math-verify package (pip install math-verify), "
                        "or set task.grader: exact") from None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled": on purpose, see above
    return math_verify


def answer_region(text: str) -> str:
    """The part of a completion or reference that is graded (see the module's docstring)."""
    boxed = text.rfind("\\boxed")
    return text[boxed:boxed + GRADED_CHARS] if boxed >= 0 else text[-GRADED_CHARS:]


def check_available() -> None:
    """A one-line error before anything starts where math-verify is missing."""
    _math_verify()


@lru_cache(maxsize=65_536)
def _parsed_reference(reference: str):
    return _math_verify().parse(reference, parsing_timeout=None)


def parses(reference: str) -> bool:
    """Whether math-verify finds an answer in `reference` (checked once per dataset line)."""
    region = answer_region(reference)
    return within_bounds(region) and bool(_parsed_reference(region))


def math_grade(reference: str, completion: str) -> float:
    """1.0 where the completion's final answer is equivalent to `reference`, else 0.0."""
    tail, reference = answer_region(completion), answer_region(reference)
    if not within_bounds(tail) or not within_bounds(reference):
        return 0.0
    math_verify = _math_verify()
    gold = _parsed_reference(reference)
    if not gold:
        return 0.0
    predicted = math_verify.parse(tail, parsing_timeout=None)
    return 1.0 if predicted and math_verify.verify(gold, predicted, timeout_seconds=None) else 0.0
