"""Accuracy statistics against values worked out by hand: sampled metrics, intervals, McNemar, the cap."""

from __future__ import annotations

import math

import pytest
from scipy.stats import beta

from rlhf_core.stats import (
    check_alpha,
    half_width,
    majority_correct,
    mcnemar_exact_p,
    paired_comparison,
    stratified_sample,
    validation_metrics,
    wilson_interval,
)

Z95 = 1.959963984540054  # the 97.5% normal quantile, from a table


def test_sampled_metrics_mean_best_and_majority_with_standard_errors():
    # prompt "a" (answer 5): right, wrong, wrong; the wrong ones agree on 7, so the vote is wrong
    # prompt "b" (answer 3): no answer, right, right; the vote is right
    sources = ["gsm8k"] * 6
    prompts = ["a", "a", "a", "b", "b", "b"]
    acc = [1, 0, 0, 0, 1, 1]
    reward = [1.0, 0.1, 0.1, 0.0, 1.0, 1.0]
    answers = ["5", "7", "7", None, "3", "3"]
    metrics = validation_metrics(sources, prompts, acc, reward, answers)
    assert metrics["val-core/gsm8k/acc/mean@3"] == pytest.approx(0.5)            # (1/3 + 2/3) / 2
    assert metrics["val-aux/gsm8k/reward/mean@3"] == pytest.approx((1.2 / 3 + 2.0 / 3) / 2)
    assert metrics["val-core/gsm8k/acc/best@3/mean"] == pytest.approx(1.0)
    assert metrics["val-core/gsm8k/acc/maj@3/mean"] == pytest.approx(0.5)
    # standard errors over the 2 prompts, sqrt(population variance / 2)
    assert metrics["val-aux/gsm8k/acc/mean@3/std"] == pytest.approx(math.sqrt((1 / 6) ** 2 / 2))
    assert metrics["val-aux/gsm8k/acc/best@3/std"] == pytest.approx(0.0)
    assert metrics["val-aux/gsm8k/acc/maj@3/std"] == pytest.approx(math.sqrt(0.25 / 2))
    assert len(metrics) == 7


def test_greedy_validation_keeps_the_mean_at_1_headline_only():
    metrics = validation_metrics(["s", "s", "t"], [0, 1, 2], [1, 0, 1], [1.0, 0.0, 1.0])
    assert metrics["val-core/s/acc/mean@1"] == 0.5
    assert metrics["val-core/t/acc/mean@1"] == 1.0
    assert metrics["val-aux/s/acc/mean@1/std"] == pytest.approx(0.5 / math.sqrt(2))
    assert not [key for key in metrics if "best@" in key or "maj@" in key]


def test_majority_vote_ties_go_to_the_first_answer_and_silence_is_wrong():
    assert majority_correct(["4", "5"], [0, 1]) == 0.0
    assert majority_correct(["5", "4"], [1, 0]) == 1.0
    assert majority_correct([None, None], [0, 0]) == 0.0


def test_no_majority_vote_without_the_answers_graded():
    # a reward function that does not say what its responses answer: mean@2 and best@2, no maj@2
    metrics = validation_metrics(["s"] * 4, [0, 0, 1, 1], [1, 0, 0, 0], [1.0, 0.0, 0.0, 0.0])
    assert metrics["val-core/s/acc/mean@2"] == pytest.approx(0.25)
    assert metrics["val-core/s/acc/best@2/mean"] == pytest.approx(0.5)
    assert not [key for key in metrics if "maj@" in key]
    with pytest.raises(ValueError, match="answers needs one entry per response"):
        validation_metrics(["s"] * 4, [0, 0, 1, 1], [1, 0, 0, 0], [1.0, 0.0, 0.0, 0.0], ["5"])


def test_prompts_without_a_ground_truth_leave_the_accuracy_and_make_the_reward_core():
    nan = float("nan")
    # source s: prompt 0 graded (1, 0), prompt 1 not (a NaN among its responses), prompt 2 graded (1, 1);
    # source u: nothing graded
    sources = ["s"] * 6 + ["u"] * 2
    prompts = [0, 0, 1, 1, 2, 2, 3, 3]
    acc = [1, 0, nan, nan, 1, 1, nan, nan]
    reward = [1.0, 0.0, 0.5, 0.3, 2.0, 1.0, 0.25, 0.75]
    answers = ["7", "8", None, None, "3", "3", None, None]
    metrics = validation_metrics(sources, prompts, acc, reward, answers)
    assert metrics["val-core/s/acc/mean@2"] == pytest.approx((0.5 + 1.0) / 2)  # prompts 0 and 2 only
    assert metrics["val-core/s/acc/best@2/mean"] == pytest.approx(1.0)
    assert metrics["val-core/s/acc/maj@2/mean"] == pytest.approx(1.0)  # the tie goes to "7" (right); "3" right
    assert metrics["val-aux/s/reward/mean@2"] == pytest.approx((0.5 + 0.4 + 1.5) / 3)  # every prompt's reward
    assert metrics["val-core/u/reward/mean@2"] == pytest.approx(0.5)
    assert not [k for k in metrics if k.startswith(("val-core/u/acc", "val-aux/u/"))]


def test_mcnemar_exact_p_values_by_hand():
    assert mcnemar_exact_p(8, 0) == pytest.approx(2 / 2 ** 8)              # 2 * P(X <= 0), X ~ Bin(8, 1/2)
    assert mcnemar_exact_p(1, 5) == pytest.approx(2 * (1 + 6) / 2 ** 6)     # C(6,0) + C(6,1)
    assert mcnemar_exact_p(3, 3) == 1.0                                      # 2 * 42/64 > 1: capped
    assert mcnemar_exact_p(0, 0) == 1.0                                      # no disagreement, no evidence
    # 30 fixed, 15 broken: 2 * sum_{k<=15} C(45, k) / 2^45, summed term by term
    term, tail = 1, 1
    for k in range(1, 16):
        term = term * (45 - k + 1) // k
        tail += term
    assert mcnemar_exact_p(30, 15) == pytest.approx(2 * tail / 2 ** 45)
    assert 0.03 < mcnemar_exact_p(30, 15) < 0.04


def test_paired_comparison_counts_the_gain_its_interval_and_p():
    # 10 problems: 4 fixed, 1 broken, 3 right in both, 2 wrong in both
    baseline = [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    candidate = [1, 1, 1, 1, 0, 1, 1, 1, 0, 0]
    c = paired_comparison(candidate, baseline)
    assert (c.n, c.fixed, c.broken) == (10, 4, 1)
    assert (c.candidate_accuracy, c.baseline_accuracy) == (pytest.approx(0.7), pytest.approx(0.4))
    assert c.gain == pytest.approx(0.3)
    # the 5 discordant problems: 4 fixed, an exact interval of the share fixed (beta quantiles), scaled to the gain
    low, high = beta.ppf(0.025, 4, 2), beta.ppf(0.975, 5, 1)  # 0.2836, 0.9949
    assert (c.ci_low, c.ci_high) == (pytest.approx(0.5 * (2 * low - 1)), pytest.approx(0.5 * (2 * high - 1)))
    assert c.p_value == pytest.approx(2 * (1 + 5) / 2 ** 5)  # 0.375
    assert not c.significant
    with pytest.raises(ValueError, match="same problems"):
        paired_comparison([1, 0], [1])


@pytest.mark.parametrize("fixed, broken", [(5, 0), (6, 0), (9, 2), (10, 2), (30, 15), (0, 0)])
def test_the_gain_interval_excludes_zero_exactly_when_the_test_rejects(fixed, broken):
    """5 fixed, 0 broken of 100: p = 2 / 2^5 = 0.0625, and the interval's lower end is 5/100 * (2 * 0.025^(1/5) - 1),
    just below 0 (a Wald interval read [+0.007, +0.093] there); 6 fixed: p = 0.03125 and the interval is above 0."""
    n = 100
    c = paired_comparison([True] * fixed + [False] * (n - fixed), [False] * fixed + [True] * broken + [False] * (n - fixed - broken))
    assert (c.fixed, c.broken) == (fixed, broken)
    assert (c.ci_low > 0) == c.significant
    assert c.ci_low <= c.gain <= c.ci_high
    if (fixed, broken) == (5, 0):
        assert c.p_value == pytest.approx(0.0625)
        assert c.ci_low == pytest.approx(0.05 * (2 * 0.025 ** 0.2 - 1)) and c.ci_low < 0 and c.ci_high == pytest.approx(0.05)


def test_wilson_interval_matches_the_table():
    low, high = wilson_interval(8, 10)
    assert (low, high) == (pytest.approx(0.4902, abs=1e-4), pytest.approx(0.9433, abs=1e-4))
    assert wilson_interval(0, 20)[0] == pytest.approx(0.0, abs=1e-12)
    assert half_width(1000) == pytest.approx(Z95 * math.sqrt(0.25 / 1000))  # +-3.1 points on 1,000 problems


@pytest.mark.parametrize("alpha", [0, 1, 1.5, -0.05, float("nan"), True])
def test_alpha_outside_zero_one_is_refused(alpha):
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        check_alpha(alpha)


def test_stratified_sample_keeps_each_source_share_and_is_seeded():
    sources = ["a"] * 80 + ["b"] * 20
    chosen = stratified_sample(sources, 10, seed=3)
    assert len(chosen) == 10 and chosen == sorted(set(chosen))
    assert sum(sources[i] == "a" for i in chosen) == 8
    assert stratified_sample(sources, 10, seed=3) == chosen
    assert stratified_sample(sources, 10, seed=4) != chosen
    assert stratified_sample(sources, None) == list(range(100))
    assert stratified_sample(sources, 500) == list(range(100))
    # shares 1.5, 1.35, 0.15 of 3: every source keeps one
    small = ["a"] * 50 + ["b"] * 45 + ["c"] * 5
    assert sorted(small[i] for i in stratified_sample(small, 3)) == ["a", "b", "c"]
    # shares 3.2, 1.6, 0.2 of 5: the floors 3, 1 and 1 (at least one) already fill the cap
    skewed = ["a"] * 64 + ["b"] * 32 + ["c"] * 4
    assert sorted(skewed[i] for i in stratified_sample(skewed, 5)) == ["a", "a", "a", "b", "c"]
    with pytest.raises(ValueError, match="max_problems"):
        stratified_sample(sources, 0)
