"""Numeric-answer reward, Calc-X style: is the agent's final number the ground truth's number?

Numbers are parsed exactly into `fractions.Fraction` (never through binary floats), so "0.1 + 0.2"-style
rounding never decides a match; the tolerance only forgives answers that were rounded on purpose.
"""

from __future__ import annotations

import math
import re
import unicodedata
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from reward_hooks.rewards.errors import RewardInputError

if TYPE_CHECKING:
    from reward_hooks.rewards.registry import RewardInput

DEFAULT_REL_TOL = 1e-6
MAX_NUMBER_CHARS = 1000  # digits and separators of a number read as an answer
MAX_EXPONENT = 1000  # |e| of a number in scientific notation read as an answer (1e999999999 is no answer)

_NUMBER = re.compile(
    r"(?<![0-9A-Za-z_.])"  # not the tail of a word, a number or a decimal ("H2O", "v1.2" hold none)
    r"([-\u2212]?)"  # sign: hyphen-minus or the Unicode minus
    r"([0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?|\.[0-9]+)(?![0-9])"  # 1,234.5 | 12.5 | .5
    r"(?:[eE]([-+\u2212]?[0-9]+))?"  # optional exponent: 1e5, 2.5E-3 ("2em" is 2; "1e9x" is 1e9, not 1)
    r"(?:[/\u2044]([-\u2212]?[0-9]+(?:\.[0-9]+)?)(?![0-9])(?:[eE]([-+\u2212]?[0-9]+))?)?"  # 3/4, 1⁄2, 1/2e3
    r"(\s?%)?"  # optional percent sign
)
_LATEX_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


def final_number(text: str) -> list[Fraction]:
    """The readings of the final number of `text`: `[]` (none), `[x]`, or `[x, x / 100]` for a percent.

    The final answer is, in this order of precedence: the content of the last `\\boxed{...}` (braces
    matched, so `\\boxed{\\frac{3}{4}}` works); else the text after the last `####` (GSM8K); else the
    whole text. Within it, after NFKC normalization and LaTeX clean-up (`\\frac{a}{b}` -> `a/b`,
    `{,}` -> `,`, `\\%` -> `%`, thin spaces `\\,` `\\!` removed), the last number counts: an integer or
    decimal, optionally signed, with optional thousands separators (`1,234,567.5`), optionally in scientific
    notation (`2.5e-3`, `1E+6`: the exponent is part of the number, so `1e999999999` is not 1; an exponent
    beyond `MAX_EXPONENT` makes it no number), optionally a fraction
    `a/b` (a zero denominator is no number), optionally followed by `%`. A `%` gives two readings, 50% being
    50 or 0.5. A boxed answer without a number yields `[]`: the declared answer is not searched around, and
    so does a final number written with more than `MAX_NUMBER_CHARS` characters (no answer needs them; Python
    would refuse to convert some of them, and comparing them costs more than any answer is worth).
    """
    text = unicodedata.normalize("NFKC", text)
    segment = _last_boxed(text)
    if segment is None:
        segment = text.rpartition("####")[2]
    segment = _LATEX_FRAC.sub(r"\1/\2", segment)
    for latex, plain in (("{,}", ","), ("\\%", "%"), ("\\,", ""), ("\\!", "")):
        segment = segment.replace(latex, plain)
    for match in reversed(list(_NUMBER.finditer(segment))):
        sign, number, exponent, denominator, denominator_exponent, percent = match.groups()
        if len(number) > MAX_NUMBER_CHARS or len(denominator or "") > MAX_NUMBER_CHARS:
            return []
        value = _scaled(Fraction(number.replace(",", "")), exponent)
        if denominator is not None:
            divisor = _scaled(Fraction(denominator.replace("\u2212", "-")), denominator_exponent)
            if divisor is None or value is None:
                return []
            if divisor == 0:
                continue
            value /= divisor
        if value is None:
            return []
        if sign:
            value = -value
        return [value, value / 100] if percent else [value]
    return []


def _scaled(value: Fraction, exponent: str | None) -> Fraction | None:
    """`value * 10**exponent`, or None for an exponent beyond `MAX_EXPONENT` (no answer needs one)."""
    if exponent is None:
        return value
    power = int(exponent.replace("\u2212", "-")) if len(exponent) <= 8 else MAX_EXPONENT + 1
    if abs(power) > MAX_EXPONENT:
        return None
    return value * Fraction(10) ** power


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` with nested braces matched (to the end if unclosed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    start += len("\\boxed{")
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return text[start:]


def _truth_values(ground_truth: Any) -> list[Fraction]:
    """Every acceptable value of a ground truth: an int, a finite float, a string (read like an answer,
    so a whole GSM8K solution ending in `#### 72` works), or a non-empty list of these."""
    if isinstance(ground_truth, bool):
        raise RewardInputError(f"ground_truth must be a number, not a boolean: {ground_truth!r}")
    if isinstance(ground_truth, int):
        return [Fraction(ground_truth)]
    if isinstance(ground_truth, float) and math.isfinite(ground_truth):
        return [Fraction(repr(ground_truth))]  # the decimal the float was written as: 0.1 -> 1/10
    if isinstance(ground_truth, str) and (values := final_number(ground_truth)):
        return values
    if isinstance(ground_truth, list | tuple) and ground_truth:
        return [value for item in ground_truth for value in _truth_values(item)]
    raise RewardInputError(f"ground_truth has no number: {ground_truth!r}")


def math_answer(inp: RewardInput) -> float:
    """1.0 if the answer's final number equals the ground truth's, within a relative tolerance, else 0.0.

    With `a` ranging over the readings of `final_number(answer)` and `g` over the ground truth's values,
    the score is 1.0 if some pair has `|a - g| <= rel_tol * max(|a|, |g|)` (computed exactly in
    fractions; `math.isclose` with `abs_tol=0`, so a ground truth of 0 needs exactly 0). `rel_tol` is
    `params["rel_tol"]`, default 1e-6. An answer with no number scores 0.0; a ground truth with no
    number, or a bad `rel_tol`, raises `RewardInputError` (a reward job fails at once: a retry cannot help).
    """
    rel_tol = inp.params.get("rel_tol", DEFAULT_REL_TOL)
    if isinstance(rel_tol, bool) or not isinstance(rel_tol, int | float) or not 0 <= rel_tol < math.inf:
        raise RewardInputError(f"params.rel_tol must be a finite number >= 0, got {rel_tol!r}")
    tolerance = Fraction(rel_tol)
    truths = _truth_values(inp.ground_truth)
    return float(
        any(abs(a - g) <= tolerance * max(abs(a), abs(g)) for a in final_number(inp.answer) for g in truths)
    )
