"""Accuracy statistics in plain python: sampled validation metrics, intervals, a paired test, a stratified cap.

* :func:`validation_metrics`: verl's validation metric names from per-sample correctness. With
  ``n`` responses per prompt: ``mean@n`` (the average correctness), ``best@n`` (pass@n: any of the
  ``n`` right), ``worst@n`` (all ``n`` right) and ``maj@n`` (the answer most responses give is right,
  where the reward function says what each response answers), per data source, each with its
  standard error over prompts, and ``std@n`` (the spread of a prompt's ``n`` responses, averaged);
  ``best@k``, ``worst@k`` and ``maj@k`` also at verl's smaller sizes ``k`` (2, 4, 8, ... below ``n``), exact
  over the ``k``-response subsets (:func:`best_and_worst_of`, :func:`majority_of`).
  ``val-core/`` holds the headline values, ``val-aux/`` the rest, as verl splits them.
* :func:`wilson_interval`: the confidence interval of one accuracy.
* :func:`paired_comparison`: two models on the same problems: the gain, its interval (Newcombe's, for
  paired proportions), and McNemar's exact test on the problems where they disagree.
* :func:`stratified_sample`: at most ``max_problems`` problems, each data source keeping its share.

No torch and no I/O: the trainer, the evaluation and the promotion rule all call into this.
"""

from __future__ import annotations

import functools
import math
import operator
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from statistics import NormalDist

import numpy as np


def check_alpha(alpha: float, key: str = "alpha") -> float:
    """``alpha`` itself when it is a significance level strictly between 0 and 1."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"{key}={alpha!r} must be a significance level strictly between 0 and 1 (e.g. 0.05)")
    return float(alpha)


def z_value(alpha: float) -> float:
    """The two-sided normal quantile: 1.96 for ``alpha=0.05``. Taken from the lower tail, ``alpha / 2`` itself:
    ``1 - alpha / 2`` loses the digits of a small ``alpha`` (and is 1.0, outside the normal's domain, below
    about 1e-16)."""
    return -NormalDist().inv_cdf(check_alpha(alpha) / 2)


def standard_error(values: Sequence[float]) -> float:
    """``sqrt(var / m)`` of ``m`` per-prompt values (population variance: ``sqrt(p (1 - p) / m)`` for 0/1)."""
    values = np.asarray(values, dtype=np.float64)
    return float(np.sqrt(values.var() / len(values))) if len(values) else float("nan")


def wilson_interval(successes: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """Wilson score interval of an accuracy ``successes / n`` at confidence ``1 - alpha``."""
    if n <= 0:
        return (float("nan"), float("nan"))
    z = z_value(alpha)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # at 0 and n the bound is 0 (or 1) exactly; in floats centre - half may land a rounding error off it
    low = 0.0 if successes <= 0 else max(0.0, centre - half)
    high = 1.0 if successes >= n else min(1.0, centre + half)
    return (low, high)


def half_width(n: int, alpha: float = 0.05, p: float = 0.5) -> float:
    """Half-width of the normal interval of an accuracy near ``p`` on ``n`` problems (widest at 0.5)."""
    return z_value(alpha) * math.sqrt(p * (1 - p) / n) if n > 0 else float("inf")


# ----------------------------------------------------------------------------- sampled metrics


def majority_correct(answers: Sequence[Hashable | None], correct: Sequence[float]) -> float:
    """Correctness of the answer most of the responses give (``None``: no answer, no vote).

    ``answers`` must be the answers ``correct`` grades (the reward function's ``pred``), so that every
    response giving the winning answer is graded alike. Ties go to the answer given first; with no
    answer at all the vote is wrong (0.0).
    """
    votes = Counter(answer for answer in answers if answer is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winner = next(answer for answer in answers if answer is not None and votes[answer] == top)
    return float(next(c for answer, c in zip(answers, correct) if answer == winner))


@functools.lru_cache(maxsize=8)
def _pascal(m: int) -> list[list[int]]:
    """Pascal's triangle to row ``m``: ``C(i, j)`` at ``[i][j]`` for ``j <= i <= m`` (a table for :func:`majority_of`
    to read, never to change)."""
    return [[math.comb(i, j) for j in range(i + 1)] for i in range(m + 1)]


@functools.lru_cache(maxsize=8192)  # (every n and length of m = 64 responses)
def _packed_binomials(n: int, terms: int, width: int) -> int:
    """``C(n, 0) + C(n, 1) y + ... `` to ``terms`` terms (``(1 + y)^n`` cut), at ``y = 2^width``: one coefficient to
    each ``width`` bits, for :func:`majority_of` to multiply as integers."""
    return sum(math.comb(n, j) << (width * j) for j in range(min(terms, n + 1)))


def majority_of(answers: Sequence[Hashable | None], correct: Sequence[float], k: int) -> float:
    """The expected :func:`majority_correct` of ``k`` of the responses drawn without replacement: its mean
    over all ``C(m, k)`` subsets of the ``m`` responses, each kept in its order (the vote of all of them
    where there are ``k`` or fewer), counted without listing the subsets.

    A subset's vote goes to the response ``p`` that is the first one drawn of its answer ``a`` (and counts
    ``correct[p]``) where ``a`` is drawn ``t`` times and every other answer fewer times, or ``t`` times but
    none of them before ``p`` (a tie goes to the answer given first). Those subsets are counted by ``p`` and
    ``t``: ``C(after_a, t - 1)`` ways to draw ``a``'s other ``t - 1`` from its ``after_a`` responses after
    ``p``, times the ways to draw the ``k - t`` left: the coefficient of ``y^(k - t)`` in the product over
    the other answers ``b`` of ``sum_{s < t} C(size_b, s) y^s + C(after_b, t) y^t`` (``s < t`` of its
    ``size_b`` responses anywhere, or ``t`` of the ``after_b`` after ``p``) and of ``(1 + y)^z`` for the
    ``z`` unanswered responses. An answer given fewer than ``t`` times contributes ``(1 + y)^size_b``, as
    the unanswered ones do: only those given ``t`` times or more are multiplied in one by one. The count
    depends on ``p`` only through the rivals with ``after_b >= t`` (the ones that can tie), so it is counted
    once for each ``t`` and set of those; where there are none (always where ``t > k - t``) it is one count
    for every response of ``a``, whose terms over ``t`` are summed at once.

    The polynomials are multiplied as integers, one coefficient to each ``m + 2`` bits (Kronecker's
    substitution: every coefficient counts subsets of the ``m`` responses, so it is below ``2^m`` and no
    field carries into the next), cut above ``y^(k - t)``: exact, in big-integer products rather than
    loops over coefficients. 1319 problems of 64 responses, with a strong or a weak model's spread of answers,
    take about 2 s of CPU for ``k`` = 2 to 32 (verl's bootstrap draws 1000 samples for each ``k``)."""
    m = len(answers)
    if k >= m:
        return majority_correct(answers, correct)
    sizes = Counter(answer for answer in answers if answer is not None)
    unanswered = m - sum(sizes.values())
    binomial = _pascal(m)  # C(i, j) for j <= i <= m
    width = m + 2  # bits a coefficient: each counts subsets of the m responses, so is below 2^m
    # the unanswered responses and those of the answers given fewer than t times, for t up to k
    free_at = [unanswered + sum(size for size in sizes.values() if size < t) for t in range(k + 1)]
    after = dict(sizes)  # each answer's responses after the one reached

    def ways(answer: Hashable, t: int, ties: bool) -> int:
        """The ways to draw the k - t left with each rival of ``answer`` drawn fewer than t times, or (``ties``)
        t times, all after the response reached: the coefficient of y^(k - t) in the product, as integers."""
        left = k - t
        cut = (1 << (width * (left + 1))) - 1  # y^0 .. y^left
        product = _packed_binomials(free_at[t], left + 1, width)  # (1 + y)^free
        for other, size in sizes.items():
            if other == answer or size < t:
                continue
            factor = _packed_binomials(size, min(t - 1, left) + 1, width)
            if ties and after[other] >= t:
                factor += binomial[after[other]][t] << (width * t)
            product = (product * factor) & cut
        return product >> (width * left)

    untied: dict[Hashable, list[int]] = {}  # answer -> the ways at t = 0 (a place holder), 1, ..., no rival tied
    tied: dict[tuple, int] = {}  # (answer, t, the rivals' after_b where >= t, else 0) -> the ways
    votes: Counter = Counter()  # value -> the subsets whose vote counts it
    for answer, value in zip(answers, correct):
        if answer is None:
            continue
        after[answer] -= 1
        if not value:  # (a vote that counts nothing: the subsets it wins need no counting)
            continue
        drawn = binomial[after[answer]]  # C(after_a, t - 1) at [t - 1]: a's other t - 1 drawn after p
        most = min(k, after[answer] + 1)  # the most of a's responses a subset can draw with p first
        # a rival can tie only at t <= k - t, and only with t of its responses after p: up to there alone the
        # count at t depends on p
        rivals_after = [n for other, n in after.items() if other != answer]  # (in one order throughout)
        ties_up_to = min(k // 2, most, max(rivals_after, default=0))
        for t in range(1, ties_up_to + 1):
            key = (answer, t, tuple(n if n >= t else 0 for n in rivals_after))  # those that can tie at t
            if key not in tied:
                tied[key] = ways(answer, t, ties=True)
            votes[value] += drawn[t - 1] * tied[key]
        if most > ties_up_to:  # the same count for every response of a
            if answer not in untied:
                untied[answer] = [0] + [ways(answer, t, ties=False) for t in range(1, min(k, sizes[answer]) + 1)]
            votes[value] += sum(map(operator.mul, drawn[ties_up_to:most], untied[answer][ties_up_to + 1:most + 1]))
    draws = math.comb(m, k)
    return float(sum(Fraction(float(value)) * Fraction(count, draws) for value, count in votes.items()))


def subset_sizes(n: int) -> list[int]:
    """The ``k`` of verl's ``best@k``, ``worst@k`` and ``maj@k`` for ``n`` responses a prompt: 2, 4, 8, ... below
    ``n``, then ``n`` (none for ``n = 1``)."""
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n] if n > 1 else []


def best_and_worst_of(values: Sequence[float], k: int) -> tuple[float, float]:
    """The expected highest and lowest of ``k`` of ``values`` drawn without replacement (all of them where there
    are ``k`` or fewer). For 0/1 correctness these are pass@k (Chen et al., 2021: ``1 - C(m - c, k) / C(m, k)`` of
    ``c`` right among ``m``) and the chance that all ``k`` are right.

    The ``i``-th smallest value (from 0) is the highest of a draw when the other ``k - 1`` come from the ``i``
    below it, ``C(i, k - 1)`` of the ``C(m, k)`` draws, and the lowest when they come from the ``m - 1 - i`` above.
    """
    ordered = sorted(values)
    m = len(ordered)
    k = min(k, m)
    draws = math.comb(m, k)
    best = sum(value * math.comb(i, k - 1) for i, value in enumerate(ordered)) / draws
    worst = sum(value * math.comb(m - 1 - i, k - 1) for i, value in enumerate(ordered)) / draws
    return float(best), float(worst)


def _best_and_worst_metrics(metrics: dict[str, float], name: str, per_prompt: Sequence[Sequence[float]], n: int,
                            core: bool) -> None:
    """``best@k`` and ``worst@k`` of ``name`` (``source/reward`` or ``source/acc``) at each of verl's sizes ``k``
    (:func:`subset_sizes`), averaged over the prompts' values (``per_prompt``), with their standard errors; all in
    ``val-aux/`` but ``best@n/mean`` where ``core``."""
    for k in subset_sizes(n):
        best, worst = zip(*(best_and_worst_of(values, k) for values in per_prompt))
        metrics[f"val-{'core' if core and k == n else 'aux'}/{name}/best@{k}/mean"] = float(np.mean(best))
        metrics[f"val-aux/{name}/best@{k}/std"] = standard_error(list(best))
        metrics[f"val-aux/{name}/worst@{k}/mean"] = float(np.mean(worst))
        metrics[f"val-aux/{name}/worst@{k}/std"] = standard_error(list(worst))


def validation_metrics(
    data_sources: Sequence[str],
    prompt_ids: Sequence[Hashable],
    acc: Sequence[float],
    reward: Sequence[float],
    answers: Sequence[Hashable | None] | None = None,
) -> dict[str, float]:
    """verl-named validation metrics from one entry per response (``n`` responses per prompt).

    Args:
        data_sources, prompt_ids: per response; responses of one prompt share its id.
        acc: 1.0 for a correct response, else 0.0; NaN where it is not known (no ground truth): a prompt
            with such a response is left out of the accuracy, and a source with no other has none. reward: its
            score.
        answers: the answer each response gives, as ``acc`` graded it (the reward function's ``pred``;
            None: no answer), for the majority vote; without them there is no ``maj@n``.

    Returns ``val-core/<source>/acc/mean@n`` and ``val-aux/<source>/reward/mean@n`` (as verl, where the reward
    is core only when there is no accuracy); for ``n > 1`` also
    ``val-core/<source>/acc/best@n/mean`` (the share of prompts with a right response among their
    ``n``: pass@n, not verl's bootstrap, which runs lower) and, given ``answers``, ``.../maj@n/mean``;
    and in ``val-aux/`` the standard error over prompts of each (``.../acc/mean@n/std``,
    ``best@n/std``, ``maj@n/std``), ``.../acc/worst@n/mean`` (the share of prompts whose ``n``
    responses are all right, exact as ``best@n``; verl's bootstrap runs higher) with its ``/std``, and
    verl's ``std@n`` of ``acc`` and ``reward``: each prompt's population standard deviation over its
    responses, averaged over prompts (not a standard error). For ``n > 1`` the reward has ``best@n/mean`` and
    ``worst@n/mean`` too (each prompt's highest and lowest reward, averaged; ``best@n`` core where the reward is)
    with their standard errors. ``best@k`` and ``worst@k`` of both, with their standard errors, at verl's sizes
    ``k`` below ``n`` (:func:`subset_sizes`) go to ``val-aux/``: the expected highest and lowest among ``k`` of a
    prompt's responses (:func:`best_and_worst_of`; pass@k for the accuracy), and so, given ``answers``, does the
    accuracy's ``maj@k`` with its standard error: the expected vote among ``k`` of a prompt's responses
    (:func:`majority_of`). ``n`` is the most responses any prompt has.
    """
    if not len(data_sources) == len(prompt_ids) == len(acc) == len(reward):
        raise ValueError("data_sources, prompt_ids, acc and reward need one entry per response")
    if answers is not None and len(answers) != len(acc):
        raise ValueError("answers needs one entry per response")
    groups: dict[str, dict[Hashable, list[int]]] = {}
    for position, (source, prompt) in enumerate(zip(data_sources, prompt_ids)):
        groups.setdefault(source, {}).setdefault(prompt, []).append(position)
    metrics: dict[str, float] = {}
    for source, prompts in groups.items():
        n = max(len(rows) for rows in prompts.values())
        mean_reward = [np.mean([reward[i] for i in rows]) for rows in prompts.values()]
        graded = {p: rows for p, rows in prompts.items() if not any(math.isnan(acc[i]) for i in rows)}
        if n > 1:  # verl's std@n: the spread of one prompt's responses (population std), averaged over prompts
            metrics[f"val-aux/{source}/reward/std@{n}"] = float(np.mean([np.std([reward[i] for i in rows])
                                                                         for rows in prompts.values()]))
            # the best and the worst reward among k of each prompt's responses, averaged (exact, as the accuracy's)
            _best_and_worst_metrics(metrics, f"{source}/reward", [[reward[i] for i in rows] for rows in prompts.values()],
                                    n, core=not graded)
        if not graded:  # prompts without a ground truth (a reward model's run): the reward is the core metric
            metrics[f"val-core/{source}/reward/mean@{n}"] = float(np.mean(mean_reward))
            continue
        mean_acc = [np.mean([acc[i] for i in rows]) for rows in graded.values()]
        metrics[f"val-core/{source}/acc/mean@{n}"] = float(np.mean(mean_acc))
        metrics[f"val-aux/{source}/reward/mean@{n}"] = float(np.mean(mean_reward))
        metrics[f"val-aux/{source}/acc/mean@{n}/std"] = standard_error(mean_acc)
        if n > 1:
            metrics[f"val-aux/{source}/acc/std@{n}"] = float(np.mean([np.std([acc[i] for i in rows])
                                                                      for rows in graded.values()]))
            # pass@k: a right response among k of the prompt's; all k right
            _best_and_worst_metrics(metrics, f"{source}/acc", [[acc[i] for i in rows] for rows in graded.values()],
                                    n, core=True)
            if answers is not None:  # the majority vote among k of the prompt's responses, exact as best@k
                for k in subset_sizes(n):
                    vote = [majority_of([answers[i] for i in rows], [acc[i] for i in rows], k)
                            for rows in graded.values()]
                    section = "val-core" if k == n else "val-aux"
                    metrics[f"{section}/{source}/acc/maj@{k}/mean"] = float(np.mean(vote))
                    metrics[f"val-aux/{source}/acc/maj@{k}/std"] = standard_error(vote)
    return metrics


# ----------------------------------------------------------------------------- paired comparison


#: discordant problems up to which McNemar's p-value is summed in exact integers (above: in floats, from logs)
EXACT_DISCORDANT = 100_000


def mcnemar_exact_p(fixed: int, broken: int) -> float:
    """Two-sided exact McNemar p-value: under "no difference" each of the ``fixed + broken``
    discordant problems is fixed or broken with probability 1/2, so the smaller count is binomial.

    The tail ``sum_{k <= m} C(d, k) / 2^d`` is summed from its largest term ``C(d, m)`` down
    (``C(d, k - 1) = C(d, k) k / (d - k + 1)``) until the terms left, which fall at least as fast as that
    ratio, add up to less than 2^-64 of the sum: in time that grows with about ``sqrt(d)`` terms, not with ``m``
    binomial coefficients computed afresh. Up to :data:`EXACT_DISCORDANT` discordant problems the terms are exact
    integers (the p-value is the exact one, rounded once; a term left out can move it by an ulp at most); above,
    floats scaled by ``C(d, m) / 2^(d - 1)`` taken from ``lgamma`` (a relative error near 1e-9 at a million)."""
    discordant = fixed + broken
    smaller = min(fixed, broken)
    if discordant == 0 or 2 * smaller >= discordant:  # equal counts: the tail is >= 1/2, doubled >= 1
        return 1.0
    if discordant <= EXACT_DISCORDANT:
        term = total = math.comb(discordant, smaller)
        for k in range(smaller, 0, -1):
            # the terms below sum to less than term * k / (d - 2k + 1) <= term * k: stop below 2^-64 of the total
            if term.bit_length() + k.bit_length() + 64 < total.bit_length():
                break
            term = term * k // (discordant - k + 1)
            total += term
        return min(1.0, total / 2 ** (discordant - 1))
    term = total = 1.0  # the terms relative to the largest
    for k in range(smaller, 0, -1):
        term *= k / (discordant - k + 1)
        total += term
        if term * k < 2 ** -64 * total * (discordant - 2 * k + 1):
            break
    log_largest = (math.lgamma(discordant + 1) - math.lgamma(smaller + 1) - math.lgamma(discordant - smaller + 1)
                   - (discordant - 1) * math.log(2))
    return min(1.0, math.exp(log_largest + math.log(total)))


@dataclass(frozen=True)
class PairedComparison:
    """Candidate against baseline on the same ``n`` problems."""

    n: int
    candidate_accuracy: float
    baseline_accuracy: float
    fixed: int    # baseline wrong, candidate right
    broken: int   # baseline right, candidate wrong
    gain: float   # candidate_accuracy - baseline_accuracy = (fixed - broken) / n
    ci_low: float
    ci_high: float
    p_value: float
    alpha: float

    @property
    def significant(self) -> bool:
        return self.p_value < self.alpha

    def to_dict(self) -> dict:
        return {**asdict(self), "significant": self.significant}


def paired_comparison(candidate: Sequence[bool], baseline: Sequence[bool], alpha: float = 0.05) -> PairedComparison:
    """The gain of ``candidate`` over ``baseline`` (per-problem correctness, same order), McNemar's exact
    p-value, and the ``1 - alpha`` interval of the gain: Newcombe's hybrid score interval for a difference of
    paired proportions (Newcombe 1998, method 10; one of those Fagerland, Lydersen and Laake 2014 recommend).
    Each accuracy gets its Wilson interval, and the two are combined with the correlation of the pairs, so the
    interval widens with the problems the two models disagree on and with the number of problems; it is not
    the test (its ends need not fall on either side of 0 exactly when the p-value does), and the promotion rule
    decides on the p-value."""
    check_alpha(alpha)
    if len(candidate) != len(baseline):
        raise ValueError(f"paired comparison needs the same problems: {len(candidate)} candidate results vs "
                         f"{len(baseline)} baseline results")
    n = len(candidate)
    if n == 0:
        raise ValueError("paired comparison of zero problems: the validation set is empty")
    pairs = Counter((bool(c), bool(b)) for c, b in zip(candidate, baseline))
    both, fixed, broken, neither = pairs[True, True], pairs[True, False], pairs[False, True], pairs[False, False]
    low, high = newcombe_paired_interval(both, fixed, broken, neither, alpha)
    return PairedComparison(n, (both + fixed) / n, (both + broken) / n, fixed, broken, (fixed - broken) / n,
                            low, high, mcnemar_exact_p(fixed, broken), alpha)


def newcombe_paired_interval(both: int, first_only: int, second_only: int, neither: int,
                             alpha: float = 0.05) -> tuple[float, float]:
    """Newcombe's hybrid score interval (method 10) for ``p1 - p2``, two proportions measured on the same
    items: ``both`` items count for each, ``first_only`` for the first alone, ``second_only`` for the second.

    With ``(l1, u1)`` and ``(l2, u2)`` the Wilson intervals of ``p1`` and ``p2`` and ``phi`` the correlation of
    the pairs (its numerator ``both * neither - first_only * second_only`` lowered by ``n / 2`` when positive,
    not below 0; 0 when a margin is empty), the ends are
    ``p1 - p2 -+ sqrt(a^2 - 2 phi a b + b^2)`` with ``(a, b) = (p1 - l1, u2 - p2)`` below and
    ``(u1 - p1, p2 - l2)`` above."""
    n = both + first_only + second_only + neither
    p1, p2 = (both + first_only) / n, (both + second_only) / n
    l1, u1 = wilson_interval(both + first_only, n, alpha)
    l2, u2 = wilson_interval(both + second_only, n, alpha)
    margins = (both + first_only) * (second_only + neither) * (both + second_only) * (first_only + neither)
    association = both * neither - first_only * second_only
    if association > 0:
        association = max(association - n / 2, 0.0)
    phi = association / math.sqrt(margins) if margins else 0.0

    def spread(a: float, b: float) -> float:
        return math.sqrt(max(0.0, a * a - 2 * phi * a * b + b * b))

    return (p1 - p2 - spread(p1 - l1, u2 - p2), p1 - p2 + spread(u1 - p1, p2 - l2))


# ----------------------------------------------------------------------------- budget


def stratified_sample(data_sources: Sequence[str], max_problems: int | None, seed: int = 0) -> list[int]:
    """Sorted positions of at most ``max_problems`` rows, each data source keeping its share.

    Each source keeps at least one row while the cap allows (with fewer rows than sources, the largest
    sources keep one each); the rest follow the shares, rounded by largest remainder: a source short of its
    share gets a row before one at or above it, and where the one-row floors overshoot the cap, rows go back
    from the sources furthest above their share. Rows within a source are drawn with a seeded generator, so
    the same data, cap and seed always give the same problems. ``None`` (or a cap >= the rows) keeps every
    row.
    """
    total = len(data_sources)
    if max_problems is None or max_problems >= total:
        return list(range(total))
    if max_problems < 1:
        raise ValueError(f"max_problems={max_problems!r} must be >= 1 (or null for every problem)")
    by_source: dict[str, list[int]] = {}
    for position, source in enumerate(data_sources):
        by_source.setdefault(source, []).append(position)
    sources = sorted(by_source)
    exact = {s: max_problems * len(by_source[s]) / total for s in sources}  # each below its rows: cap < total
    if max_problems < len(sources):
        kept = sorted(sources, key=lambda s: (-exact[s], s))[:max_problems]
        quota = {s: int(s in kept) for s in sources}
    else:
        quota = {s: max(1, math.floor(exact[s])) for s in sources}
        while sum(quota.values()) > max_problems:  # the one-row floors overshoot: back from the furthest over
            over = max((s for s in sources if quota[s] > 1),
                       key=lambda s: (quota[s] - exact[s], -sources.index(s)))
            quota[over] -= 1
        while sum(quota.values()) < max_problems:  # the rest to the sources furthest short of their share
            short = max((s for s in sources if quota[s] < len(by_source[s])),
                        key=lambda s: (exact[s] - quota[s], -sources.index(s)))
            quota[short] += 1
    rng = np.random.default_rng(seed)
    chosen = [int(p) for s in sources for p in rng.choice(by_source[s], size=quota[s], replace=False)]
    return sorted(chosen)
