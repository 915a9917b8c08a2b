"""What a reward function returned, read once: the one reader behind training's reward manager
(:class:`rlhf_core.rewards.manager.RewardManager`) and the pipeline's self-check of a reward on the reference
solutions (:func:`rlhf_core.pipeline.evaluate.check_reference_solutions`), so that a result one accepts the other
accepts too.

A result is a score (a bool, int or float, a numpy scalar, or a tensor or array of one number and no dimension) or
a dict with such a ``"score"``, an optional ``"acc"`` (right above 0; None or absent: ``score >= full_score``; NaN:
not graded), an optional ``"pred"`` (the answer given) and other entries, of which the numeric ones are metrics. A
score must be finite.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from dataclasses import dataclass, field

import numpy as np
import torch


class RewardResultError(Exception):
    """A result that is not a score, said as ``returned <what>; <advice>``: the reward manager puts the function's
    name and the sample between the two (``reward function 'f' returned <what> for sample 3 (...); <advice>``)."""

    def __init__(self, returned: str, advice: str) -> None:
        super().__init__(f"returned {returned}; {advice}")
        self.returned, self.advice = returned, advice


class NotAScore(RewardResultError, TypeError):
    """Neither a number nor a dict with a numeric ``"score"`` (or its ``"acc"`` is no number)."""


class NotFinite(RewardResultError, ValueError):
    """A score of NaN or inf, which would turn every advantage and weight it reaches into NaN."""


def as_number(value: object) -> float | None:
    """A reward result's number as a float, or None where it is none: a real number (bool, int, float, numpy
    scalar), not a complex or a string, or a tensor or array of one number and no dimension (``torch.tensor(0.5)``,
    an element of a batch function's tensor of scores; verl's managers write such a value into the reward tensor
    as they do a float). numpy's bool is not a ``numbers.Real``, and ``np.isclose(...)`` returns one: without it an
    ``acc`` of that type went unread. An integer too large for a float reads as inf of its sign (float() raised
    OverflowError, which no reader caught)."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
        value = value.item()
    if not isinstance(value, (numbers.Real, np.bool_)):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


@dataclass(frozen=True)
class RewardResult:
    """One result read: its score, acc (1.0 or 0.0 from the score where the function gave none; NaN: not graded),
    whether it gave a ``"pred"`` and which (as text, None for none), and its other numeric entries."""

    score: float
    acc: float
    extra: dict[str, float] = field(default_factory=dict)
    has_pred: bool = False
    pred: str | None = None

    @property
    def full_marks(self) -> bool:
        """Right, as the evaluation counts it: an acc of 1. A partial acc (0.2) or a NaN one (not graded) is not,
        and the evaluation refuses both (it counts each problem right or wrong)."""
        return self.acc == 1.0


def awaited(result: object) -> object:
    """A reward function's result, run to its end where the function is ``async def`` (verl awaits such a
    ``compute_score``): its coroutine's value; any other result as it is."""
    if inspect.iscoroutine(result):
        return asyncio.run(result)
    return result


def read_reward_result(result: object, full_score: float = 1.0) -> RewardResult:
    """``result`` read as training reads it; :class:`NotAScore` or :class:`NotFinite` where training refuses it."""
    if isinstance(result, dict):
        score = as_number(result.get("score"))
        if score is None:
            what = (f"a 'score' of {type(result['score']).__name__} ({result['score']!r:.60})" if "score" in result
                    else f"no 'score' (keys {sorted(map(str, result))})")
            raise NotAScore(f"a dict with {what}", "return a number or a dict whose 'score' entry is one")
        acc_value = result.get("acc")
        acc = as_number(acc_value) if acc_value is not None else float(score >= full_score)
        if acc is None:
            raise NotAScore(f"a non-numeric 'acc' ({acc_value!r:.60})",
                            "'acc' must be a bool or a number (1 for a correct answer), or left out")
        numbers_in = {str(key): as_number(value) for key, value in result.items()
                      if key not in ("score", "acc", "pred")}
        extra = {key: value for key, value in numbers_in.items() if value is not None}
        has_pred = "pred" in result
        pred = None if result.get("pred") is None else str(result["pred"])
    elif (number := as_number(result)) is not None:
        score, acc, extra, has_pred, pred = number, float(number >= full_score), {}, False, None
    else:
        raise NotAScore(f"{type(result).__name__} ({result!r:.60})",
                        "it must return a number (float, int, bool, or a tensor of one) or a dict with a 'score' key")
    if not math.isfinite(score):
        raise NotFinite(f"a non-finite score ({score})", "a score must be a finite number")
    return RewardResult(score, acc, extra, has_pred, pred)
