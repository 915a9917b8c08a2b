"""Rule-based reward for GSM8K-style answers.

A response is graded on its final numeric answer only. Two ways of finding it:

* ``strict``: the answer must follow ``#### `` (the format the prompt asks for); the last
  such marker in the response wins, and one followed by only ``.`` or ``,`` holds no answer (verl's rule
  would take ``"."`` as a wrong answer, worth the format score).
* ``flexible``: the last number anywhere in the response, whatever surrounds it.

Only the last :data:`SOLUTION_CLIP_CHARS` characters of a response are searched, which bounds
the regex cost on runaway generations and matches where a final answer belongs.
The extracted answer (commas and dollar signs removed) must equal the ground truth, cleaned the same way,
exactly as strings: ``"18"`` and ``"18.0"`` are different answers, ``"1,000"`` and ``"1000"`` the same. A
ground truth stored as a number (a numeric parquet column) is written as the number it is, at its own precision
and without an exponent: ``18.0`` as ``18``, a numpy float32 ``0.1`` as ``0.1``, ``1e-05`` as ``0.00001`` (a
float32 parquet field reads back as a double, ``0.10000000149011612``, which no answer matches: preflight refuses
such values).
:func:`unanswerable` says why a right answer, written as numbers are, cannot match a ground truth (a list, a
word, ``"18.0"``).
"""

from __future__ import annotations

import decimal
import numbers
import re

import numpy as np

SOLUTION_CLIP_CHARS = 300
METHODS = ("strict", "flexible")

_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"(-?[0-9.,]+)")
_NOT_A_NUMBER = ("", ".")


def _clean(text: str) -> str:
    return text.replace(",", "").replace("$", "")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer found in ``solution_str`` by ``method``, cleaned of ``,`` and ``$``; None if none."""
    if method not in METHODS:
        raise ValueError(f"unknown GSM8K extraction method {method!r}; use one of {list(METHODS)}")
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be a str, got {type(solution_str).__name__}")
    tail = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":  # the last marker's digits; a marker followed by only "." or "," holds no answer
        matches = _STRICT.findall(tail)
        answer = _clean(matches[-1]) if matches else None
        return None if answer in _NOT_A_NUMBER else answer
    for candidate in reversed(_NUMBER.findall(tail)):
        cleaned = _clean(candidate)
        if cleaned not in _NOT_A_NUMBER:
            return cleaned
    return None


def expected_answer(ground_truth) -> str:
    """``ground_truth`` as an extracted answer is compared with it: cleaned of ``,`` and ``$``, and a number
    (not a string) with an integral value written without its fraction (``18.0`` -> ``"18"``)."""
    if isinstance(ground_truth, bytes):  # a binary parquet column: its text
        ground_truth = ground_truth.decode()
    if isinstance(ground_truth, numbers.Real) and not isinstance(ground_truth, (bool, np.bool_)):
        if float(ground_truth).is_integer():
            return str(int(ground_truth))
        # the shortest digits that read back as the stored value, in its own precision (float32's 0.1 is not
        # 0.10000000149011612), never in exponent form (1e-05): the form a response's answer takes
        return np.format_float_positional(ground_truth, unique=True, trim="-")
    return _clean(str(ground_truth).strip())


# A ground truth's text as the rule's answers are written: a number of digits without leading zeros, with a minus
# and a dollar sign where it has them, thousands commas, and decimals with a digit other than 0 ("2.50" as money
# is written). Other text ("4.0", ".5", "007", "12 apples") either matches no answer or only one written as oddly
# ("#### 4.0", "#### .5"), which a right response rarely is: the rule compares strings. The data validation
# checks stored text with this pattern too.
ANSWERABLE_TEXT = r"^\s*(?:-\$?|\$-?)?(?:0|[1-9][0-9,]*)(?:\.[0-9]*[1-9][0-9]*)?\$?\s*$"
_ANSWERABLE = re.compile(ANSWERABLE_TEXT)
_ZERO_FRACTION = re.compile(r"-?[0-9]+\.0*")


def unanswerable(ground_truth) -> str | None:
    """Why a right response, its answer written as numbers are (``#### 18``, ``#### 0.5``), would not earn the
    rule's score against ``ground_truth``, or None where it would: a ground truth that is not a number or text of
    the form :data:`ANSWERABLE_TEXT` (a list, a word, ``".5"``), or an integer written with a fraction of zeros
    (``"18.0"``, what a float column turned to text gives)."""
    if isinstance(ground_truth, (bool, np.bool_)) or not isinstance(ground_truth, (str, bytes, numbers.Real,
                                                                                 decimal.Decimal)):
        return f"a {type(ground_truth).__name__} ({ground_truth!r:.40}), not a number or the text of one"
    answer = expected_answer(ground_truth)  # a number written as the rule writes it; text cleaned
    text = answer if isinstance(ground_truth, numbers.Real) else (
        ground_truth.decode() if isinstance(ground_truth, bytes) else str(ground_truth))
    if _ANSWERABLE.match(text):
        return None
    if _ZERO_FRACTION.fullmatch(answer):
        return (f"{text.strip()!r} is an integer written with a fraction of zeros: responses answering "
                f"'#### {answer.split('.')[0]}' score 0 (the rule compares strings); store it as "
                f"{answer.split('.')[0]!r}")
    return (f"{text.strip()!r} is not a number as answers write them (digits, a leading minus or $, thousands "
            "commas, decimals: e.g. 0.5, not .5): the rule compares the text after '#### ' with it")


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` if the extracted answer equals ``ground_truth``; ``format_score`` if an answer was
    found but is wrong; 0.0 if no answer was found."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    if answer == expected_answer(ground_truth):
        return float(score)
    return float(format_score)
