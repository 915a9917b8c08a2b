"""When a newly trained policy replaces the one in production: the decision, in plain python.

The rule:

* a candidate is compared with the current production version's accuracy; when there is no
  production version yet (or it carries no accuracy), with the base model it was trained from;
* it is promoted when it beats that baseline by at least ``min_improvement`` (an absolute
  difference of accuracies, 0.02 = two points) and by more than nothing at all: a tie never
  replaces production;
* a run that did not train (retraining on unchanged data) is never promoted.

Accuracies are shares in [0, 1]. Differences are compared with a tolerance of 1e-9 so that
0.52 - 0.50 counts as the 0.02 it is.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

_TOLERANCE = 1e-9


@dataclass(frozen=True)
class PromotionDecision:
    """The outcome and everything needed to explain it later."""

    promote: bool
    reason: str
    candidate_accuracy: float | None
    baseline: str  # "production", "base_model" or "none"
    baseline_accuracy: float | None
    min_improvement: float
    production_version: str | None = None

    @property
    def improvement(self) -> float | None:
        if self.candidate_accuracy is None or self.baseline_accuracy is None:
            return None
        return self.candidate_accuracy - self.baseline_accuracy

    def to_dict(self) -> dict:
        return {**asdict(self), "improvement": self.improvement}


def _check_accuracy(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= 1):
        raise ValueError(f"{name}={value!r} must be an accuracy in [0, 1] (or None when unknown)")


def decide(
    candidate_accuracy: float | None,
    base_accuracy: float | None,
    production_accuracy: float | None = None,
    production_version: str | None = None,
    min_improvement: float = 0.0,
    skipped_reason: str | None = None,
) -> PromotionDecision:
    """Decide whether the candidate goes to production.

    Args:
        candidate_accuracy: greedy validation accuracy of the newly trained policy.
        base_accuracy: the same measure for the model training started from.
        production_accuracy: the current production version's accuracy, None when there is
            none (or it was never measured).
        production_version: its name or number, for the reason text.
        min_improvement: the margin the candidate must beat the baseline by (>= 0).
        skipped_reason: set when the run did not train; the candidate is then never promoted.
    """
    if min_improvement < 0 or not math.isfinite(min_improvement):
        raise ValueError(f"min_improvement={min_improvement!r} must be a finite number >= 0")
    for name, value in (("candidate_accuracy", candidate_accuracy), ("base_accuracy", base_accuracy),
                        ("production_accuracy", production_accuracy)):
        _check_accuracy(name, value)

    if production_accuracy is not None:
        baseline, baseline_accuracy = "production", production_accuracy
        label = f"production version {production_version}" if production_version else "the production version"
    elif base_accuracy is not None:
        baseline, baseline_accuracy = "base_model", base_accuracy
        label = "the base model (no production version yet)"
    else:
        baseline, baseline_accuracy, label = "none", None, ""

    def outcome(promote: bool, reason: str) -> PromotionDecision:
        return PromotionDecision(promote, reason, candidate_accuracy, baseline, baseline_accuracy,
                                 min_improvement, production_version)

    if skipped_reason:
        return outcome(False, f"not promoted: training was skipped ({skipped_reason})")
    if candidate_accuracy is None:
        return outcome(False, "not promoted: the candidate has no accuracy (evaluation did not run)")
    if baseline_accuracy is None:
        return outcome(False, "not promoted: there is neither a production version nor a base model accuracy "
                              "to compare with")

    improvement = candidate_accuracy - baseline_accuracy
    numbers = (f"accuracy {candidate_accuracy:.4f} vs {baseline_accuracy:.4f} of {label}: "
               f"{improvement:+.4f}, required " +
               (f">= {min_improvement:.4f}" if min_improvement > _TOLERANCE else "> 0 (any gain)"))
    if improvement > _TOLERANCE and improvement >= min_improvement - _TOLERANCE:
        return outcome(True, f"promoted: {numbers}")
    if improvement <= _TOLERANCE and min_improvement <= _TOLERANCE:
        return outcome(False, f"not promoted: no improvement ({numbers})")
    return outcome(False, f"not promoted: improvement too small ({numbers})")
