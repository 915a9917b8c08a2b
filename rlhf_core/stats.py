"""Accuracy statistics in plain python: sampled validation metrics, intervals, a paired test, a stratified cap.

* :func:`validation_metrics`: verl's validation metric names from per-sample correctness. With
  ``n`` responses per prompt: ``mean@n`` (the average correctness), ``best@n`` (pass@n: any of the
  ``n`` right) and ``maj@n`` (the answer most responses give is right, where the reward function
  says what each response answers), per data source, each with its standard error over prompts.
  ``val-core/`` holds the headline values, ``val-aux/`` their standard errors.
* :func:`wilson_interval`: the confidence interval of one accuracy.
* :func:`paired_comparison`: two models on the same problems: the gain, its interval, and McNemar's
  exact test on the problems where they disagree.
* :func:`stratified_sample`: at most ``max_problems`` problems, each data source keeping its share.

No torch and no I/O: the trainer, the evaluation and the promotion rule all call into this.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np


def check_alpha(alpha: float, key: str = "alpha") -> float:
    """``alpha`` itself when it is a significance level strictly between 0 and 1."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"{key}={alpha!r} must be a significance level strictly between 0 and 1 (e.g. 0.05)")
    return float(alpha)


def z_value(alpha: float) -> float:
    """The two-sided normal quantile: 1.96 for ``alpha=0.05``."""
    return NormalDist().inv_cdf(1 - check_alpha(alpha) / 2)


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
    return (max(0.0, centre - half), min(1.0, centre + half))


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
    ``best@n/std``, ``maj@n/std``). ``n`` is the most responses any prompt has.
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
        if not graded:  # prompts without a ground truth (a reward model's run): the reward is the core metric
            metrics[f"val-core/{source}/reward/mean@{n}"] = float(np.mean(mean_reward))
            continue
        mean_acc = [np.mean([acc[i] for i in rows]) for rows in graded.values()]
        metrics[f"val-core/{source}/acc/mean@{n}"] = float(np.mean(mean_acc))
        metrics[f"val-aux/{source}/reward/mean@{n}"] = float(np.mean(mean_reward))
        metrics[f"val-aux/{source}/acc/mean@{n}/std"] = standard_error(mean_acc)
        if n > 1:
            best = [max(acc[i] for i in rows) for rows in graded.values()]
            metrics[f"val-core/{source}/acc/best@{n}/mean"] = float(np.mean(best))
            metrics[f"val-aux/{source}/acc/best@{n}/std"] = standard_error(best)
            if answers is not None:
                vote = [majority_correct([answers[i] for i in rows], [acc[i] for i in rows])
                        for rows in graded.values()]
                metrics[f"val-core/{source}/acc/maj@{n}/mean"] = float(np.mean(vote))
                metrics[f"val-aux/{source}/acc/maj@{n}/std"] = standard_error(vote)
    return metrics


# ----------------------------------------------------------------------------- paired comparison


def mcnemar_exact_p(fixed: int, broken: int) -> float:
    """Two-sided exact McNemar p-value: under "no difference" each of the ``fixed + broken``
    discordant problems is fixed or broken with probability 1/2, so the smaller count is binomial."""
    discordant = fixed + broken
    if discordant == 0:
        return 1.0
    tail = sum(math.comb(discordant, k) for k in range(min(fixed, broken) + 1)) / 2 ** discordant
    return min(1.0, 2 * tail)


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


def _at_least(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in log space (exact enough for thousands of trials)."""
    if k <= 0 or p >= 1:
        return 1.0
    if k > n or p <= 0:
        return 0.0
    logs = [math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * math.log(p)
            + (n - j) * math.log1p(-p) for j in range(k, n + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(value - top) for value in logs))


def _solve(f, target: float, increasing: bool) -> float:
    """The p in [0, 1] where the monotone ``f(p)`` reaches ``target``, by bisection."""
    low, high = 0.0, 1.0
    for _ in range(100):
        middle = (low + high) / 2
        if (f(middle) < target) == increasing:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def clopper_pearson(successes: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """The exact ``1 - alpha`` interval of a binomial proportion: each bound leaves ``alpha / 2`` in its tail."""
    low = 0.0 if successes == 0 else _solve(lambda p: _at_least(successes, n, p), alpha / 2, increasing=True)
    high = 1.0 if successes == n else _solve(lambda p: 1 - _at_least(successes + 1, n, p), alpha / 2,
                                             increasing=False)
    return low, high


def paired_comparison(candidate: Sequence[bool], baseline: Sequence[bool], alpha: float = 0.05) -> PairedComparison:
    """The gain of ``candidate`` over ``baseline`` (per-problem correctness, same order), McNemar's exact
    p-value and the ``1 - alpha`` interval of the gain that agrees with it: given the ``d = fixed + broken``
    problems where the two differ, the gain is ``d / n * (2 q - 1)`` with ``q`` the share of them fixed, so
    the exact (Clopper-Pearson) interval of ``q`` gives the gain's. It excludes 0 exactly when the test
    rejects at ``alpha`` (both are the binomial test of ``q = 1/2``); a Wald interval could exclude 0 beside
    a p-value above ``alpha`` (5 fixed, 0 broken of 100: [+0.007, +0.093] at p = 0.0625)."""
    check_alpha(alpha)
    if len(candidate) != len(baseline):
        raise ValueError(f"paired comparison needs the same problems: {len(candidate)} candidate results vs "
                         f"{len(baseline)} baseline results")
    n = len(candidate)
    if n == 0:
        raise ValueError("paired comparison of zero problems: the validation set is empty")
    fixed = sum(1 for c, b in zip(candidate, baseline) if c and not b)
    broken = sum(1 for c, b in zip(candidate, baseline) if b and not c)
    discordant = fixed + broken
    low, high = clopper_pearson(fixed, discordant, alpha) if discordant else (0.5, 0.5)
    return PairedComparison(n, sum(map(bool, candidate)) / n, sum(map(bool, baseline)) / n, fixed, broken,
                            (fixed - broken) / n, discordant / n * (2 * low - 1), discordant / n * (2 * high - 1),
                            mcnemar_exact_p(fixed, broken), alpha)


# ----------------------------------------------------------------------------- budget


def stratified_sample(data_sources: Sequence[str], max_problems: int | None, seed: int = 0) -> list[int]:
    """Sorted positions of at most ``max_problems`` rows, each data source keeping its share.

    Shares are rounded by largest remainder (every source keeps at least one row while the cap
    allows); rows within a source are drawn with a seeded generator, so the same data, cap and
    seed always give the same problems. ``None`` (or a cap >= the rows) keeps every row.
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
    exact = {s: max_problems * len(by_source[s]) / total for s in sources}
    quota = {s: min(len(by_source[s]), max(1, math.floor(exact[s]))) for s in sources}
    while sum(quota.values()) > max_problems:  # more sources than the cap: drop the smallest shares
        smallest = min((s for s in sources if quota[s] > 0), key=lambda s: (exact[s], s))
        quota[smallest] -= 1
    by_remainder = sorted(sources, key=lambda s: (-(exact[s] - math.floor(exact[s])), s))
    while sum(quota.values()) < max_problems:  # hand out the rest, largest remainder first
        for s in by_remainder:
            if sum(quota.values()) < max_problems and quota[s] < len(by_source[s]):
                quota[s] += 1
    rng = np.random.default_rng(seed)
    chosen = [int(p) for s in sources for p in rng.choice(by_source[s], size=quota[s], replace=False)]
    return sorted(chosen)
