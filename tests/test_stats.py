"""Accuracy statistics against values worked out by hand: sampled metrics, intervals, McNemar, the cap."""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from rlhf_core.stats import (
    check_alpha,
    half_width,
    majority_correct,
    majority_of,
    mcnemar_exact_p,
    paired_comparison,
    stratified_sample,
    validation_metrics,
    wilson_interval,
    z_value,
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
    # std@3: each prompt's population std over its 3 responses, averaged; 1 of 3 or 2 of 3 right: sqrt(2/9)
    assert metrics["val-aux/gsm8k/acc/std@3"] == pytest.approx(math.sqrt(2) / 3)
    # rewards (1, 0.1, 0.1): mean 0.4, squares 0.36 + 0.09 + 0.09 = 0.54, sqrt(0.54 / 3); (0, 1, 1): sqrt(2/9)
    assert metrics["val-aux/gsm8k/reward/std@3"] == pytest.approx((math.sqrt(0.18) + math.sqrt(2) / 3) / 2)
    assert metrics["val-aux/gsm8k/acc/worst@3/mean"] == 0.0  # each prompt has a wrong response
    assert metrics["val-aux/gsm8k/acc/worst@3/std"] == 0.0
    # the reward's best and worst response per prompt: (1.0, 0.1) and (1.0, 0.0); aux, the accuracy being core
    assert metrics["val-aux/gsm8k/reward/best@3/mean"] == 1.0
    assert metrics["val-aux/gsm8k/reward/best@3/std"] == 0.0
    assert metrics["val-aux/gsm8k/reward/worst@3/mean"] == pytest.approx(0.05)
    assert metrics["val-aux/gsm8k/reward/worst@3/std"] == pytest.approx(math.sqrt(0.05 ** 2 / 2))
    # and among 2 of each prompt's 3 responses (verl's sizes 2, 4, ... below n; aux): of the 3 pairs, prompt "a"
    # has a right one in 2 and none all right, prompt "b" a right one in all 3 and both right in 1
    assert metrics["val-aux/gsm8k/acc/best@2/mean"] == pytest.approx((2 / 3 + 1) / 2)
    assert metrics["val-aux/gsm8k/acc/best@2/std"] == pytest.approx(math.sqrt((1 / 6) ** 2 / 2))
    assert metrics["val-aux/gsm8k/acc/worst@2/mean"] == pytest.approx((0 + 1 / 3) / 2)
    assert metrics["val-aux/gsm8k/acc/worst@2/std"] == pytest.approx(math.sqrt((1 / 6) ** 2 / 2))
    # rewards (1, .1, .1): pair highs 1, 1, .1 and lows .1, .1, .1; (0, 1, 1): highs 1, 1, 1 and lows 0, 0, 1
    assert metrics["val-aux/gsm8k/reward/best@2/mean"] == pytest.approx((2.1 / 3 + 1) / 2)
    assert metrics["val-aux/gsm8k/reward/best@2/std"] == pytest.approx(math.sqrt(0.15 ** 2 / 2))
    assert metrics["val-aux/gsm8k/reward/worst@2/mean"] == pytest.approx((0.1 + 1 / 3) / 2)
    assert metrics["val-aux/gsm8k/reward/worst@2/std"] == pytest.approx(math.sqrt(((1 / 3 - 0.1) / 2) ** 2 / 2))
    # the vote among 2 of the 3 (aux): prompt "a" (5, 7, 7): 5 and 7 tie, to the first, right, twice; 7 and 7 wrong;
    # prompt "b" (none, 3, 3): 3 wins every pair, right
    assert metrics["val-aux/gsm8k/acc/maj@2/mean"] == pytest.approx((2 / 3 + 1) / 2)
    assert metrics["val-aux/gsm8k/acc/maj@2/std"] == pytest.approx(math.sqrt((1 / 6) ** 2 / 2))
    assert len(metrics) == 25


def test_best_and_worst_at_k_below_n_at_verls_sizes():
    # one prompt, 5 responses, 2 right: pass@2 = 1 - C(3, 2) / C(5, 2) = 7/10, both right C(2, 2) / C(5, 2) = 1/10;
    # pass@4 = 1 - C(3, 4) / C(5, 4) = 1 (any 4 hold a right one), all 4 right: none
    metrics = validation_metrics(["s"] * 5, [0] * 5, [0, 1, 0, 1, 0], [0.0, 1.0, 0.0, 1.0, 0.0])
    assert sorted(key for key in metrics if "/acc/best@" in key and key.endswith("/mean")) == [
        "val-aux/s/acc/best@2/mean", "val-aux/s/acc/best@4/mean", "val-core/s/acc/best@5/mean"]
    assert metrics["val-aux/s/acc/best@2/mean"] == pytest.approx(0.7)
    assert metrics["val-aux/s/acc/worst@2/mean"] == pytest.approx(0.1)
    assert metrics["val-aux/s/acc/best@4/mean"] == pytest.approx(1.0)
    assert metrics["val-aux/s/acc/worst@4/mean"] == 0.0
    assert (metrics["val-core/s/acc/best@5/mean"], metrics["val-aux/s/acc/worst@5/mean"]) == (1.0, 0.0)
    assert not [key for key in metrics if "maj@" in key and "@5" not in key]
    # rewards 3, 1, 4, 1, 5: the mean of the highest (lowest) of each of the 10 pairs, counted by hand
    # pairs: (3,1) (3,4) (3,1) (3,5) (1,4) (1,1) (1,5) (4,1) (4,5) (1,5)
    metrics = validation_metrics(["s"] * 5, [0] * 5, [0] * 5, [3.0, 1.0, 4.0, 1.0, 5.0])
    assert metrics["val-aux/s/reward/best@2/mean"] == pytest.approx((3 + 4 + 3 + 5 + 4 + 1 + 5 + 4 + 5 + 5) / 10)
    assert metrics["val-aux/s/reward/worst@2/mean"] == pytest.approx((1 + 3 + 1 + 3 + 1 + 1 + 1 + 1 + 4 + 1) / 10)
    # a prompt with fewer responses than k takes all of them: (2, 0) among prompts of 4
    metrics = validation_metrics(["s"] * 6, [0, 0, 0, 0, 1, 1], [1, 0, 0, 0, 1, 0], [0.0] * 6)
    assert metrics["val-aux/s/acc/best@2/mean"] == pytest.approx((1 / 2 + 1) / 2)  # 3 of 6 pairs; the one pair
    assert metrics["val-core/s/acc/best@4/mean"] == 1.0


def test_worst_and_std_at_n_by_hand_in_val_aux_as_verl():
    # prompt 0: both right; prompt 1: one of two; prompt 2: neither
    acc = [1, 1, 1, 0, 0, 0]
    reward = [1.0, 1.0, 1.0, 0.0, 0.0, 0.5]
    metrics = validation_metrics(["s"] * 6, [0, 0, 1, 1, 2, 2], acc, reward)
    assert metrics["val-aux/s/acc/worst@2/mean"] == pytest.approx(1 / 3)          # prompt 0 alone all right
    assert metrics["val-aux/s/acc/worst@2/std"] == pytest.approx(math.sqrt(2 / 27))  # sqrt((1/3)(2/3) / 3)
    assert metrics["val-core/s/acc/best@2/mean"] == pytest.approx(2 / 3)
    assert metrics["val-aux/s/acc/std@2"] == pytest.approx((0 + 0.5 + 0) / 3)      # (1, 0): std 0.5
    assert metrics["val-aux/s/reward/std@2"] == pytest.approx((0 + 0.5 + 0.25) / 3)  # (0, 0.5): std 0.25
    # verl's split: mean, best and maj are core; std and worst are aux
    assert not [key for key in metrics if key.startswith("val-core/") and ("std@" in key or "worst@" in key)]


def test_greedy_validation_keeps_the_mean_at_1_headline_only():
    metrics = validation_metrics(["s", "s", "t"], [0, 1, 2], [1, 0, 1], [1.0, 0.0, 1.0])
    assert metrics["val-core/s/acc/mean@1"] == 0.5
    assert metrics["val-core/t/acc/mean@1"] == 1.0
    assert metrics["val-aux/s/acc/mean@1/std"] == pytest.approx(0.5 / math.sqrt(2))
    assert not [key for key in metrics if "best@" in key or "maj@" in key or "worst@" in key or "std@" in key]


def test_majority_vote_ties_go_to_the_first_answer_and_silence_is_wrong():
    assert majority_correct(["4", "5"], [0, 1]) == 0.0
    assert majority_correct(["5", "4"], [1, 0]) == 1.0
    assert majority_correct([None, None], [0, 0]) == 0.0


def _vote(answers, correct):
    """A subset's majority vote, written out: the answer given most (None is no vote), a tie to the one given first;
    the correctness of the first response giving it; no answer at all: 0."""
    counts = Counter(answer for answer in answers if answer is not None)
    if not counts:
        return Fraction(0)
    winner = next(answer for answer in answers if counts.get(answer) == max(counts.values()))
    return Fraction(correct[answers.index(winner)])


def _vote_over_subsets(answers, correct, k):
    """The mean vote over every k-subset of the responses, each in its order, listed one by one (exact)."""
    subsets = list(itertools.combinations(range(len(answers)), min(k, len(answers))))
    return sum(_vote([answers[i] for i in subset], [correct[i] for i in subset]) for subset in subsets) / len(subsets)


def test_majority_at_k_by_hand():
    # 7, 5, 7, no answer; 7 is right. Of the 6 pairs: (7, 5) tie, to 7: right; (7, 7) right; (7, -) right twice;
    # (5, 7) tie, to 5: wrong; (5, -) wrong: 4 of 6
    assert majority_of(["7", "5", "7", None], [1, 0, 1, 0], 2) == 2 / 3
    # of the 4 triples: (7, 5, 7) right, (7, 5, -) tie to 7: right, (7, 7, -) right, (5, 7, -) tie to 5: wrong
    assert majority_of(["7", "5", "7", None], [1, 0, 1, 0], 3) == 3 / 4
    assert majority_of(["7", "5", "7", None], [1, 0, 1, 0], 4) == 1.0  # all four: 7 twice
    assert majority_of([None, None, "3"], [0, 0, 1], 2) == 2 / 3  # a pair of no answers votes wrong


def test_majority_at_k_takes_numpy_scores():
    # pairs of (1, 2, 1), 1 right: (1, 2) tie, to 1: right; (1, 1) right; (2, 1) tie, to 2: wrong
    assert majority_of(["1", "2", "1"], list(np.array([1, 0, 1], dtype=np.float32)), 2) == 2 / 3


@pytest.mark.parametrize("seed", range(6))
def test_majority_at_k_is_the_mean_vote_over_every_k_subset(seed):
    """Against the subsets listed one by one, for every k up to m: answers with ties, unanswered responses, and
    correctness that differs within an answer (the first response giving the winner decides, as maj@n)."""
    rng = np.random.default_rng(seed)
    for _ in range(25):
        m = int(rng.integers(1, 11))
        alphabet = [None, "1", "2", "3", "4"][: int(rng.integers(2, 6))]
        answers = [alphabet[i] for i in rng.integers(0, len(alphabet), size=m)]
        right = {answer: float(rng.integers(0, 2)) for answer in alphabet}
        by_answer = [right[answer] if answer is not None else 0.0 for answer in answers]
        mixed = [float(v) for v in rng.choice([0.0, 0.5, 1.0], size=m)]
        for correct in (by_answer, mixed):
            for k in range(1, m + 1):
                assert majority_of(answers, correct, k) == float(_vote_over_subsets(answers, correct, k)), \
                    (answers, correct, k)


def test_majority_at_k_of_many_responses_counts_without_listing_the_subsets():
    """64 responses, 32 drawn: 1.8e18 subsets, never listed. Two answers given 30 times each, in turn (the right
    one first), and four unanswered: the vote is right where more of the right answer's responses are drawn, or
    as many and its first drawn comes first; a sum over the numbers drawn of each, worked out here."""
    answers = ["right", "wrong"] * 30 + [None] * 4  # right at 0, 2, ..., 58; wrong at 1, 3, ..., 59
    correct = [1.0, 0.0] * 30 + [0.0] * 4
    total = math.comb(64, 32)
    # x of the right ones, y of the wrong ones and the 32 - x - y left of the four unanswered
    expected = Fraction(0)
    for x in range(33):
        for y in range(33 - x):
            rest = 32 - x - y
            if rest > 4 or x < y or x == 0:
                continue
            ways = math.comb(30, x) * math.comb(30, y) * math.comb(4, rest)
            if x > y:
                expected += Fraction(ways, total)
            else:  # the right answer's first drawn, its i-th (at 2i, from 0), comes before the wrong one's: its
                # x - 1 others among the 29 - i after it, the x wrong ones among the 30 - i after 2i
                first = sum(math.comb(30 - i - 1, x - 1) * math.comb(30 - i, y) for i in range(30))
                expected += Fraction(first * math.comb(4, rest), total)
    started = time.perf_counter()
    assert majority_of(answers, correct, 32) == float(expected)
    assert time.perf_counter() - started < 10  # (well under a second)


def test_majority_at_k_by_hand_with_ties_a_split_answer_and_no_answers():
    # 7 (right), 5, 7 (half right: the first 7 drawn decides), 5, no answer; each subset written out in the comments
    answers, correct = ["7", "5", "7", "5", None], [1.0, 0.0, 0.5, 0.0, 0.0]
    assert majority_of(answers, correct, 1) == pytest.approx(0.3)  # one response: its own value, none for no answer
    # pairs: 7-5 (tie, 7 first) 1, 7-7 1, 7-5 1, 7-none 1, 5-7 0, 5-5 0, 5-none 0, 7-5 (the second 7) 0.5,
    # 7-none 0.5, 5-none 0: 5 of 10
    assert majority_of(answers, correct, 2) == 0.5
    # triples: 757 1, 755 0, 75- 1, 775 1, 77- 1, 75- 1, 575 0, 57- 0, 55- 0, 75- 0.5: 5.5 of 10
    assert majority_of(answers, correct, 3) == pytest.approx(0.55)
    # four (one left out): without the first 7, 5 leads (0); 775- 1; 755- 0; 757- 1; 7575 a tie, 7 first: 1
    assert majority_of(answers, correct, 4) == pytest.approx(0.6)
    assert majority_of(answers, correct, 5) == 1.0  # all: two 7s, two 5s, 7 first
    # a three-way tie at 3 of 5: 3, 4 (right), 5, 4, 3. Triples: 345 0, 344 1, 343 0, 354 0, 353 0, 343 0, 454 1,
    # 453 (all once: 4 first) 1, 443 1, 543 0: 4 of 10; pairs: a 4 first wins (45, 44, 43, 43): 4 of 10
    assert majority_of(["3", "4", "5", "4", "3"], [0.0, 1.0, 0.0, 1.0, 0.0], 3) == pytest.approx(0.4)
    assert majority_of(["3", "4", "5", "4", "3"], [0.0, 1.0, 0.0, 1.0, 0.0], 2) == pytest.approx(0.4)
    assert majority_of([None, None, None], [0.0, 0.0, 0.0], 2) == 0.0  # no answer in any pair


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
    assert metrics["val-aux/s/acc/worst@2/mean"] == pytest.approx(0.5)  # prompts 0 (1, 0) and 2 (1, 1)
    assert metrics["val-aux/s/acc/std@2"] == pytest.approx((0.5 + 0.0) / 2)  # graded prompts only
    assert metrics["val-aux/s/reward/std@2"] == pytest.approx((0.5 + 0.1 + 0.5) / 3)  # every prompt's reward
    assert metrics["val-aux/u/reward/std@2"] == pytest.approx(0.25)  # (0.25, 0.75): the reward's spread
    # nothing graded in u: its reward's best@2 is core, as its mean@2 (verl's rule); in s the accuracy is core
    assert metrics["val-core/u/reward/best@2/mean"] == 0.75
    assert metrics["val-aux/u/reward/worst@2/mean"] == 0.25
    assert metrics["val-aux/s/reward/best@2/mean"] == pytest.approx((1.0 + 0.5 + 2.0) / 3)
    assert metrics["val-aux/s/reward/worst@2/mean"] == pytest.approx((0.0 + 0.3 + 1.0) / 3)
    assert not [k for k in metrics if k.startswith(("val-core/u/acc", "val-aux/u/acc"))]


def test_a_prompt_with_some_responses_ungraded_is_left_out_of_the_accuracy_whole():
    nan = float("nan")
    # prompt 1 has one ungraded response (NaN) beside a right one: it leaves the accuracy, as a prompt with none
    # graded does; prompts 0 (1, 0; answers 7, 8: the tie to "7", right) and 2 (1, 1; "3" twice, right) remain
    acc = [1, 0, nan, 1, 1, 1]
    reward = [1.0, 0.0, 0.5, 1.0, 1.0, 1.0]
    metrics = validation_metrics(["s"] * 6, [0, 0, 1, 1, 2, 2], acc, reward, ["7", "8", None, "3", "3", "3"])
    assert metrics["val-core/s/acc/mean@2"] == pytest.approx((0.5 + 1.0) / 2)
    assert metrics["val-core/s/acc/best@2/mean"] == 1.0
    assert metrics["val-core/s/acc/maj@2/mean"] == 1.0
    assert metrics["val-aux/s/acc/worst@2/mean"] == pytest.approx((0.0 + 1.0) / 2)
    assert metrics["val-aux/s/reward/mean@2"] == pytest.approx((0.5 + 0.75 + 1.0) / 3)  # every prompt's reward
    assert all(math.isfinite(value) for value in metrics.values()), metrics


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


# reference p-values: scipy.stats.binomtest(min(fixed, broken), fixed + broken, 0.5).pvalue (scipy 1.17), and for
# a million discordant problems 2 * scipy.stats.binom.cdf(min(fixed, broken), fixed + broken, 0.5)
@pytest.mark.parametrize("fixed, broken, reference, rel", [
    (13, 37, 0.000936222910851825, 1e-12),
    (100, 150, 0.0018833009350761602, 1e-12),
    (20, 0, 1.9073486328125e-06, 1e-12),
    (0, 5, 0.0625, 1e-12),
    (233, 267, 0.13991852556297388, 1e-12),
    (4900, 5100, 0.04658552770494645, 1e-12),
    (49500, 50500, 0.0015823598788515154, 1e-12),
    (495000, 505000, 1.538155504390233e-23, 1e-8),   # above EXACT_DISCORDANT: from lgamma, about 1e-9 off
    (499800, 500200, 0.6898932248642693, 1e-8),
])
def test_mcnemar_exact_p_matches_the_binomial_test_up_to_a_million_discordant_problems(fixed, broken, reference, rel):
    """Summing C(d, k) afresh for every k took about 3 s at 10,000 discordant problems and 3 minutes at 40,000;
    from the largest term down, each comes in well under a second."""
    start = time.perf_counter()
    assert mcnemar_exact_p(fixed, broken) == pytest.approx(reference, rel=rel)
    assert mcnemar_exact_p(broken, fixed) == mcnemar_exact_p(fixed, broken)
    assert time.perf_counter() - start < 10


def test_mcnemar_exact_p_is_the_exact_tail_rounded_once():
    # the exact rational 2 * sum_{k <= m} C(d, k) / 2^d, rounded once by Python's int / int, for every split up to
    # 80 discordant problems (past 64 the sum stops early once the terms left are below 2^-64 of it)
    for d in range(1, 81):
        for fixed in range(d + 1):
            smaller = min(fixed, d - fixed)
            exact = min(1.0, sum(math.comb(d, k) for k in range(smaller + 1)) / 2 ** (d - 1))
            assert mcnemar_exact_p(fixed, d - fixed) == exact


def test_paired_comparison_counts_the_gain_its_interval_and_p():
    # 10 problems: 4 fixed, 1 broken, 3 right in both, 2 wrong in both
    baseline = [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    candidate = [1, 1, 1, 1, 0, 1, 1, 1, 0, 0]
    c = paired_comparison(candidate, baseline)
    assert (c.n, c.fixed, c.broken) == (10, 4, 1)
    assert (c.candidate_accuracy, c.baseline_accuracy) == (pytest.approx(0.7), pytest.approx(0.4))
    assert c.gain == pytest.approx(0.3)
    assert c.ci_low < c.gain < c.ci_high
    assert c.p_value == pytest.approx(2 * (1 + 5) / 2 ** 5)  # 0.375
    assert not c.significant
    with pytest.raises(ValueError, match="same problems"):
        paired_comparison([1, 0], [1])


def _pairs(both, first_only, second_only, neither):
    first = [True] * (both + first_only) + [False] * (second_only + neither)
    second = [True] * both + [False] * first_only + [True] * second_only + [False] * neither
    return first, second


@pytest.mark.parametrize("table, published", [
    # Fagerland, Lydersen and Laake (2014, Stat Med 33: 2850), Newcombe's hybrid score interval on two examples:
    # complete response before and after consolidation therapy (Cavo et al. 2012): 59 both, 6 and 16 one, 80 none
    ((59, 6, 16, 80), (-0.1186, -0.0046)),
    # airway hyper-responsiveness before and after stem cell transplantation (Bentur et al. 2009)
    ((1, 1, 7, 12), (-0.507, -0.026)),
])
def test_the_gain_interval_is_newcombes_for_paired_proportions(table, published):
    c = paired_comparison(*_pairs(*table))
    digits = len(str(published[0]).split(".")[1])
    assert (round(c.ci_low, digits), round(c.ci_high, digits)) == published
    assert c.gain == pytest.approx((table[1] - table[2]) / sum(table))


def test_the_gain_interval_follows_alpha():
    """Newcombe's first example (59 both, 6 and 16 one, 80 none) at 99%, z = 2.5758293035489004 from a table.
    Worked out apart from this package, to 40 digits, with each Wilson end a root of
    (n + z^2) p^2 - (2x + z^2) p + x^2 / n = 0: 65/161 in (0.3098512, 0.5052231), 75/161 in (0.3679409, 0.5664403);
    phi = (59 * 80 - 6 * 16 - 161 / 2) / sqrt(65 * 96 * 75 * 86) = 0.7161737; the ends -10/161 -+
    sqrt(a^2 - 2 phi a b + b^2), (a, b) the two accuracies' distances to their lower and upper ends (below) and upper
    and lower (above), give (-0.1356385, +0.0130766), wider than the 95% (-0.1186, -0.0046)."""
    c = paired_comparison(*_pairs(59, 6, 16, 80), alpha=0.01)
    assert (c.ci_low, c.ci_high) == (pytest.approx(-0.13563850636498036, abs=1e-9),
                                     pytest.approx(0.013076551184499905, abs=1e-9))
    assert c.alpha == 0.01


def test_models_that_always_agree_still_get_an_interval_as_wide_as_n_allows():
    """10 problems all right for both: each accuracy's Wilson interval is [n / (n + z^2), 1], so the gain's is
    +-z^2 / (n + z^2) = +-0.2775, not the [0, 0] of an interval conditioned on the problems they disagree on."""
    c = paired_comparison([True] * 10, [True] * 10)
    half = Z95 ** 2 / (10 + Z95 ** 2)
    assert (c.ci_low, c.ci_high) == (pytest.approx(-half), pytest.approx(half))
    assert c.p_value == 1.0


def test_the_gain_interval_covers_the_true_gain_about_as_often_as_it_says():
    """Draws of 100 problems with 8% fixed and none broken (true gain +0.08): an interval that takes the number
    of disagreements as known covered the gain in about 55% of draws; a 95% interval must come near 95%."""
    rng = np.random.default_rng(0)
    draws = rng.multinomial(100, [0.40, 0.08, 0.0, 0.52], size=400)
    covered = 0
    for both, fixed, broken, neither in draws:
        c = paired_comparison(*_pairs(int(both), int(fixed), int(broken), int(neither)))
        covered += c.ci_low <= 0.08 <= c.ci_high
    assert covered / len(draws) >= 0.88


def test_wilson_interval_matches_the_table():
    low, high = wilson_interval(8, 10)
    assert (low, high) == (pytest.approx(0.4902, abs=1e-4), pytest.approx(0.9433, abs=1e-4))
    assert wilson_interval(0, 20)[0] == pytest.approx(0.0, abs=1e-12)


def test_wilson_interval_ends_at_0_and_1_exactly_for_none_and_all_right():
    """In floats the centre minus the half-width at 0 of 40 came to 6.9e-18 (and 40 of 40 to 1 - 1.1e-16): a
    negative error bar the report's plot refused. By the formula, the bound is 0 (1) exactly."""
    for n in range(1, 2001):
        low, high = wilson_interval(0, n)
        assert low == 0.0 and high == pytest.approx(Z95 ** 2 / (n + Z95 ** 2))
        low, high = wilson_interval(n, n)
        assert high == 1.0 and low == pytest.approx(n / (n + Z95 ** 2))
    assert half_width(1000) == pytest.approx(Z95 * math.sqrt(0.25 / 1000))  # +-3.1 points on 1,000 problems


# reference intervals: statsmodels.stats.proportion.proportion_confint(k, n, alpha, method="wilson") (0.15.0);
# at n of n its upper end is 1 - 1e-16 in floats, where the formula gives 1 exactly
@pytest.mark.parametrize("k, n, alpha, reference", [
    (3, 7, 0.05, (0.15821985525146964, 0.7495416354723428)),
    (0, 1, 0.05, (0.0, 0.7934506856227627)),
    (1, 1, 0.01, (0.13097754328018574, 1.0)),
    (123, 1000, 0.1, (0.10692639310384754, 0.14110808229893185)),
    (1, 10 ** 9, 0.05, (1.7652455495696288e-10, 5.664934243297439e-09)),
    (500, 1000, 0.001, (0.4482516044524614, 0.5517483955475386)),
])
def test_wilson_interval_matches_statsmodels(k, n, alpha, reference):
    assert wilson_interval(k, n, alpha) == pytest.approx(reference, rel=1e-12, abs=1e-15)


def test_the_normal_quantile_keeps_its_digits_for_a_small_alpha():
    """1 - alpha / 2 kept three digits of z at alpha = 1e-15 (8.014 for 8.027) and was 1.0 below about 1e-16, where
    the quantile raised StatisticsError: an alpha the promotion gate takes failed the promote step after training.
    Reference: scipy.stats.norm.isf(alpha / 2)."""
    assert z_value(0.05) == pytest.approx(Z95, rel=1e-15)
    assert z_value(1e-15) == pytest.approx(8.02685888253454, rel=1e-12)
    assert z_value(1e-17) == pytest.approx(8.573944076720883, rel=1e-12)
    low, high = wilson_interval(10, 20, alpha=1e-17)
    assert 0 < low < 0.5 < high < 1


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


@pytest.mark.parametrize("counts, cap, expected", [
    # shares 0.9, 3.55, 2.55 of 7: floors 1 (raised from 0), 3, 2, and the last row to a source short of its share
    ({"a": 90, "b": 355, "c": 255}, 7, {"a": 1, "b": 4, "c": 2}),
    # shares 0.61, 0.83, 2.26, 0.30 of 4: one each (the largest gives back the row its floor had)
    ({"s0": 14, "s1": 19, "s2": 52, "s3": 7}, 4, {"s0": 1, "s1": 1, "s2": 1, "s3": 1}),
    # shares 0.26, 0.09, 1.32, 4.31, 5.02 of 11: the floors overshoot by one, taken from the one furthest over
    ({"s0": 3, "s1": 1, "s2": 15, "s3": 49, "s4": 57}, 11, {"s0": 1, "s1": 1, "s2": 1, "s3": 4, "s4": 4}),
    # fewer rows than sources: the largest sources keep one each
    ({"a": 30, "b": 10, "c": 1}, 2, {"a": 1, "b": 1, "c": 0}),
])
def test_stratified_sample_keeps_every_source_the_cap_allows_and_rounds_to_the_shares(counts, cap, expected):
    sources = [name for name, count in counts.items() for _ in range(count)]
    chosen = stratified_sample(sources, cap, seed=1)
    assert {name: sum(sources[i] == name for i in chosen) for name in counts} == expected
