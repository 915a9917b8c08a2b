"""The promotion rule, worked out by hand: beat production (or, first, the base model) by the margin."""

from __future__ import annotations

import pytest

from rlhf_core.pipeline.promotion import decide


def test_first_version_is_compared_with_the_base_model():
    decision = decide(candidate_accuracy=0.42, base_accuracy=0.30)
    assert decision.promote
    assert decision.baseline == "base_model"
    assert decision.baseline_accuracy == 0.30
    assert decision.improvement == pytest.approx(0.12)
    assert decision.reason.startswith("promoted: accuracy 0.4200 vs 0.3000 of the base model")


def test_first_version_that_does_not_beat_the_base_model_stays_out():
    decision = decide(candidate_accuracy=0.30, base_accuracy=0.30)
    assert not decision.promote
    assert "no improvement" in decision.reason


def test_production_is_the_baseline_once_there_is_one():
    # 0.55 beats the base model (0.30) by far but production (0.54) only by 0.01 < 0.02
    decision = decide(0.55, 0.30, production_accuracy=0.54, production_version="3", min_improvement=0.02)
    assert not decision.promote
    assert decision.baseline == "production"
    assert decision.production_version == "3"
    assert "improvement too small" in decision.reason
    assert "production version 3" in decision.reason


@pytest.mark.parametrize(
    ("candidate", "production", "margin", "promoted"),
    [
        (0.52, 0.50, 0.02, True),   # exactly the margin: 0.52 - 0.50 is 0.020000000000000018 in floats
        (0.30, 0.28, 0.02, True),   # ... and 0.019999999999999962 here: the tolerance makes both count
        (0.519, 0.50, 0.02, False),
        (0.51, 0.50, 0.0, True),    # any gain with no margin
        (0.50, 0.50, 0.0, False),   # a tie never replaces production
        (0.49, 0.50, 0.0, False),
    ],
)
def test_margin_against_production(candidate, production, margin, promoted):
    assert decide(candidate, 0.1, production_accuracy=production, min_improvement=margin).promote is promoted


def test_a_skipped_run_is_never_promoted():
    decision = decide(None, None, production_accuracy=0.5, skipped_reason="the data is unchanged")
    assert not decision.promote
    assert decision.reason == "not promoted: training was skipped (the data is unchanged)"


def test_missing_accuracies_are_explained():
    assert "has no accuracy" in decide(None, 0.3).reason
    assert "neither a production version nor a base model" in decide(0.3, None).reason


@pytest.mark.parametrize("bad", [{"candidate_accuracy": 1.5, "base_accuracy": 0.1},
                                 {"candidate_accuracy": 0.5, "base_accuracy": float("nan")},
                                 {"candidate_accuracy": 0.5, "base_accuracy": 0.1, "min_improvement": -0.1}])
def test_invalid_inputs_are_rejected(bad):
    with pytest.raises(ValueError):
        decide(**bad)


def test_decision_serialises_with_its_improvement():
    record = decide(0.6, 0.4).to_dict()
    assert record["promote"] is True
    assert record["improvement"] == pytest.approx(0.2)
    assert set(record) >= {"reason", "baseline", "baseline_accuracy", "min_improvement", "production_version"}
