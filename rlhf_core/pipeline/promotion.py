"""When a newly trained policy replaces the one in production: the decision, in plain python.

The rule:

* the candidate is compared problem by problem with the current production version on the same
  validation problems; when there is no production version yet, with the base model it was
  trained from (evaluated in the same run, on the same problems);
* it is promoted only when its gain in accuracy is at least ``min_improvement`` (an absolute
  difference, 0.02 = two points), more than nothing (a tie never replaces production), *and*
  significant: McNemar's exact test on the problems where the two disagree gives ``p < alpha``. The p-value is
  two-sided; with the gain required to be positive, the rule promotes a candidate no better than its baseline with
  a chance of at most ``alpha / 2`` (a one-sided test at ``alpha / 2``).
  On a few hundred problems a couple of points is noise; this gate says so instead of promoting;
* a run that did not train (retraining on unchanged data) is never promoted, and neither is a
  candidate that cannot be compared: production's evaluation was on other problems (their
  fingerprints, over ids, prompts, ground truths and extra_info, differ), scored otherwise, or kept no per-problem results, and production has no
  checkpoint to evaluate again (the evaluate step evaluates production's checkpoint on the
  candidate's problems when it has one).

The reason states the gain, its ``1 - alpha`` confidence interval and the p-value. Accuracies are
shares in [0, 1]; gains are compared with a tolerance of 1e-9 so that 0.52 - 0.50 counts as 0.02.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rlhf_core.stats import PairedComparison, check_alpha, paired_comparison

_TOLERANCE = 1e-9


def clears_gate(gain: float, p_value: float, min_improvement: float, alpha: float) -> bool:
    """The gate on a comparison's figures: a gain, of at least ``min_improvement``, with ``p < alpha``."""
    return gain > _TOLERANCE and gain >= min_improvement - _TOLERANCE and p_value < alpha


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
    alpha: float = 0.05
    comparison: PairedComparison | None = None

    @property
    def improvement(self) -> float | None:
        if self.candidate_accuracy is None or self.baseline_accuracy is None:
            return None
        return self.candidate_accuracy - self.baseline_accuracy

    def to_dict(self) -> dict[str, Any]:
        record = {key: value for key, value in asdict(self).items() if key != "comparison"}
        record["improvement"] = self.improvement
        if self.comparison is not None:
            c = self.comparison
            record.update(p_value=c.p_value, gain_ci=[c.ci_low, c.ci_high], fixed=c.fixed, broken=c.broken,
                          n_compared=c.n)
        return record


def _check_results(name: str, values: Sequence[bool] | None) -> list[bool] | None:
    if values is None:
        return None
    values = list(values)
    if not all(isinstance(v, bool) or v in (0, 1) for v in values):
        raise ValueError(f"{name} must be per-problem correctness (true/false), got {values[:5]!r}...")
    return [bool(v) for v in values]


#: a promoting decision's state on the model version: "pending" from before the stage is set until it is, then
#: "done". A record "pending" says the stage change may not have happened; one without it was never a promotion.
#: "refused": a retry of the step refused what an earlier attempt had recorded pending (production changed since)
PROMOTION = "promotion"


def stage_disagreement(is_production: bool, metadata: Mapping[str, Any]) -> str | None:
    """What it means where a version's stage (``is_production``) and the promote step's record on it
    (``metadata``) disagree; None where they agree. promote records a promotion as pending, sets the stage, then
    marks it done: a run that stopped between leaves the record pending, whichever side of the stage change it
    stopped on. A version archived since it was promoted agrees with its record (``promoted: true``)."""
    if metadata.get(PROMOTION) == "pending":
        if is_production:
            return ("in production, but its promotion was not marked done: the run stopped after setting the stage; "
                    "its decision and figures were recorded before the stage was set")
        return ("promotion decided but not carried out: the run stopped before the stage was set (or just after, "
                "and another version was promoted since); it is not production")
    if is_production and metadata.get("promoted") is not True:
        return ("in production, but no promotion is recorded on it: the stage was set outside the promote step, or "
                "by a run that stopped before recording its decision")
    return None


def check_gate(min_improvement: float, alpha: float) -> None:
    """Refuse a promotion gate that cannot be applied: the pipelines call it while they compile, so that a bad
    value fails before any step runs, not at the promote step after training."""
    if not (isinstance(min_improvement, (int, float)) and not isinstance(min_improvement, bool)
            and math.isfinite(min_improvement) and min_improvement >= 0):
        raise ValueError(f"min_improvement={min_improvement!r} must be a finite number >= 0")
    if min_improvement >= 1:  # a gain is a difference of accuracies: at most 1, so nothing would ever be promoted
        raise ValueError(f"min_improvement={min_improvement!r} is a gain in accuracy, a fraction below 1 (0.02 for "
                         "2 points): no candidate could be promoted")
    check_alpha(alpha, "alpha")


CACHE_REFUSAL = ("enable_cache: true would replay earlier runs' steps from ZenML's cache: their data checks, "
                 "training, evaluation and promotion decision, recorded under this run. These pipelines run every "
                 "step afresh: remove enable_cache from the run config (to carry on from a failed run's checkpoint, "
                 "put trainer.resume_mode=resume_path and trainer.resume_from_path in its overrides)")


def check_not_cached() -> None:
    """Refuse a run config's ``enable_cache: true`` while a pipeline compiles (ZenML sets it on every step): the
    cache would replay an earlier run's data checks, training, evaluation and promotion decision, and record them
    under this run, on data that may have changed since."""
    from zenml import get_pipeline_context

    if get_pipeline_context().enable_cache:
        raise ValueError(CACHE_REFUSAL)


#: scoring settings that evaluation records hold only since a later version of this package: where one of two
#: records lacks one, it is unknown there (not "unset"), and the two are compared without it
RECORDED_LATER = frozenset({"batch_size"})


#: the keys that say how a run goes on from a checkpoint, not what it trains (section -> key -> its default): a
#: pipeline run resumed from a failed run's checkpoint trains what an unbroken run of its config would
RESUME_KEYS = {
    "trainer": {"resume_mode": "auto", "resume_from_path": None, "allow_reward_code_change": False},
    "reward_model.train": {"resume_mode": "auto", "resume_from_path": None},
}


def config_fingerprint(ppo_config: Mapping[str, Any]) -> str:
    """SHA-256 of the trainer config without its data paths: the dataset fingerprint stands for the data's
    content (and stays the same when the files move), so the same data from another folder is the same training.
    Recorded on every version that trains; the retraining gate compares it with production's.

    The resume keys (:data:`RESUME_KEYS`) count at their defaults, whatever they are set to: a version trained by
    a run resumed from a failed run's checkpoint (``trainer.resume_mode=resume_path``, as the failure advises) is
    the training of the config without them, and the next retraining with that config must not train it again.
    (A config that sets none of them fingerprints as it did before they were left out.)"""
    config = json.loads(json.dumps(ppo_config, default=str))  # a copy to normalise
    config["data"] = {k: v for k, v in config.get("data", {}).items() if k not in ("train_files", "val_files")}
    for path, defaults in RESUME_KEYS.items():
        section = config
        for key in path.split("."):
            section = section.get(key) if isinstance(section, dict) else None
        if isinstance(section, dict):
            section.update({key: value for key, value in defaults.items() if key in section})
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


#: what a training is besides its data, and the key of its fingerprint on a model version
TRAINING_FINGERPRINTS = (("trainer config", "config_fingerprint"), ("reward", "reward_sha256"))


def changed_since(production_metadata: Mapping[str, Any], config_sha256: str, reward_sha256: str | None) -> list[str]:
    """What of this training differs from the one production recorded: ``"trainer config"``, ``"reward"`` (a
    version that recorded no fingerprint of one, made before versions kept it, is taken as unchanged in it:
    :func:`unrecorded` names those)."""
    now = dict(zip((key for _, key in TRAINING_FINGERPRINTS), (config_sha256, reward_sha256), strict=True))
    return [what for what, key in TRAINING_FINGERPRINTS
            if key in production_metadata and production_metadata[key] != now[key]]


def unrecorded(production_metadata: Mapping[str, Any]) -> list[str]:
    """What of its training a version recorded no fingerprint of (:data:`TRAINING_FINGERPRINTS`)."""
    return [what for what, key in TRAINING_FINGERPRINTS if key not in production_metadata]


def scoring_settings(reward_sha256: str, data: Any, **how_run: Any) -> dict[str, Any]:
    """What decides a response's grade besides the model's weights: the reward (its spec's sha256), the prompt
    and response budgets (``data``: a :class:`~rlhf_core.config.DataConfig`) and ``how_run``, how the policies
    ran (dtype, device, model config overrides, batch size: greedy responses in bfloat16 on a GPU are not
    float32's, and a prompt left-padded to another width in a batch of others can round to another token)."""
    settings = {"reward_sha256": reward_sha256, "max_prompt_length": data.max_prompt_length,
                "max_response_length": data.max_response_length, "truncation": data.truncation, **how_run}
    if getattr(data, "apply_chat_template_kwargs", None):  # (only when set: records without it compare as before)
        settings["apply_chat_template_kwargs"] = dict(data.apply_chat_template_kwargs)
    return settings


def match_production(candidate: Mapping[str, Any], production: Mapping[str, Any] | None,
                     production_version: str | None) -> tuple[dict[str, bool] | None, str | None]:
    """Production's per-problem correctness on the candidate's problems, or why it cannot be compared.

    ``candidate`` and ``production`` are evaluation records holding ``val_fingerprint`` (and the rule it follows,
    ``val_fingerprint_version``: 1 where a record lacks it), ``problems``
    (``{problem_id: correct}``) and ``scoring`` (what decides a response's grade besides the model:
    :func:`scoring_settings`). Returns ``(results, None)`` when they were evaluated on the same problems
    and scored alike, ``(None, refusal)`` otherwise.
    """
    label = f"production version {production_version}" if production_version else "the production version"
    if production is None or not production.get("problems"):
        return None, f"{label} kept no per-problem evaluation results to pair with"
    theirs, ours = production.get("val_fingerprint"), candidate.get("val_fingerprint")
    rules = [record.get("val_fingerprint_version", 1) for record in (production, candidate)]
    if rules[0] != rules[1]:  # the same problems fingerprint otherwise: whether they are these cannot be told
        return None, (f"{label}'s evaluation record fingerprints its validation problems by another rule (version "
                      f"{rules[0]} vs {rules[1]} here; version 2 added each problem's extra_info), so it cannot tell "
                      "whether they were these")
    if theirs != ours:
        return None, (f"{label} was evaluated on other validation problems (fingerprint {str(theirs)[:12]} vs "
                      f"{str(ours)[:12]} here)")
    theirs, ours = production.get("scoring"), candidate.get("scoring")
    if theirs is not None and ours is not None:  # an older record's setting that it did not hold yet: unknown
        theirs, ours = ({k: v for k, v in record.items() if k not in RECORDED_LATER or k in theirs.keys() & ours.keys()}
                        for record in (theirs, ours))
    if theirs is not None and ours is not None and theirs != ours:  # records from before it was kept: unknown
        changed = sorted(key for key in set(theirs) | set(ours) if theirs.get(key) != ours.get(key))
        return None, (f"{label} was scored otherwise on these problems ({', '.join(changed)} changed since), so its "
                      "results and the candidate's do not measure the same thing")
    results = production["problems"]
    missing = [pid for pid in candidate["problems"] if pid not in results]
    if missing:
        return None, f"{label} has no result for problem(s) {missing[:5]} although the fingerprints match"
    return {pid: bool(results[pid]) for pid in candidate["problems"]}, None


def decide(
    candidate: Sequence[bool] | None,
    base: Sequence[bool] | None,
    production: Sequence[bool] | None = None,
    production_version: str | None = None,
    min_improvement: float = 0.0,
    alpha: float = 0.05,
    skipped_reason: str | None = None,
    refusal: str | None = None,
) -> PromotionDecision:
    """Decide whether the candidate goes to production.

    Args:
        candidate: per-problem greedy correctness of the newly trained policy.
        base: the same for the model training started from, on the same problems (same order).
        production: the same for the current production version, None when there is none.
        production_version: its name or number, for the reason text.
        min_improvement: the margin (absolute accuracy) the candidate must gain over the baseline (>= 0).
        alpha: significance level of McNemar's exact test, in (0, 1).
        skipped_reason: set when the run did not train; the candidate is then never promoted.
        refusal: set when production exists but cannot be compared (see :func:`match_production`).
    """
    check_gate(min_improvement, alpha)
    candidate, base, production = (_check_results(name, values) for name, values in
                                   (("candidate", candidate), ("base", base), ("production", production)))

    if production is not None or refusal:
        baseline, baseline_results = "production", production
        label = f"production version {production_version}" if production_version else "the production version"
    elif base is not None:
        baseline, baseline_results, label = "base_model", base, "the base model (no production version yet)"
    else:
        baseline, baseline_results, label = "none", None, ""

    def accuracy(values: list[bool] | None) -> float | None:
        return sum(values) / len(values) if values else None

    def outcome(promote: bool, reason: str, comparison: PairedComparison | None = None) -> PromotionDecision:
        return PromotionDecision(promote, reason, accuracy(candidate), baseline, accuracy(baseline_results),
                                 min_improvement, production_version, alpha, comparison)

    if skipped_reason:
        return outcome(False, f"not promoted: training was skipped ({skipped_reason})")
    if refusal:
        return outcome(False, f"not promoted: cannot compare with production: {refusal}")
    if not candidate:
        return outcome(False, "not promoted: the candidate has no per-problem results (evaluation did not run)")
    if baseline_results is None:
        return outcome(False, "not promoted: there is neither a production version nor a base model evaluation "
                              "to compare with")

    c = paired_comparison(candidate, baseline_results, alpha)
    required = f">= {min_improvement:.4f}" if min_improvement > _TOLERANCE else "> 0 (any gain)"
    numbers = (f"accuracy {c.candidate_accuracy:.4f} vs {c.baseline_accuracy:.4f} of {label} on the same "
               f"{c.n} problems: gain {c.gain:+.4f}, {100 * (1 - alpha):g}% CI [{c.ci_low:+.4f}, {c.ci_high:+.4f}], "
               f"McNemar exact p = {c.p_value:.4g} ({c.fixed} fixed, {c.broken} broken); required gain {required} "
               f"and p < {alpha:g}")
    if clears_gate(c.gain, c.p_value, min_improvement, alpha):
        return outcome(True, f"promoted: {numbers}", c)
    if c.gain <= _TOLERANCE:
        return outcome(False, f"not promoted: no improvement ({numbers})", c)
    if c.gain < min_improvement - _TOLERANCE:
        return outcome(False, f"not promoted: improvement too small ({numbers})", c)
    return outcome(False, f"not promoted: the gain is not significant, within the noise of {c.n} problems "
                          f"({numbers})", c)


def decide_from_evaluation(evaluation: Mapping[str, Any], production_version: str | None,
                           min_improvement: float = 0.0, alpha: float = 0.05,
                           skipped_reason: str | None = None) -> PromotionDecision:
    """:func:`decide` on the evaluate step's record: per-problem results of the candidate (``problems``),
    the base model (``base_problems``) and production (``production_results``, or the
    ``production_refusal`` why not), all keyed by problem id. ``production_version`` is the production
    version now; if it is not the one the evaluation paired with, production changed during the run
    and the comparison is refused."""
    problems = evaluation.get("problems") or {}
    refusal = evaluation.get("production_refusal")
    paired_with = evaluation.get("production_version")
    if not skipped_reason and paired_with != production_version:  # also production archived meanwhile (None)
        now = f"version {production_version}" if production_version is not None else "no version"
        refusal = (f"production is {now} but the evaluation was paired with "
                   f"{'version ' + str(paired_with) if paired_with else 'no production version'}: production "
                   "changed during this run; run it again")
    production = evaluation.get("production_results")
    return decide(
        candidate=list(problems.values()) if problems else None,
        base=[evaluation["base_problems"][pid] for pid in problems] if problems else None,
        production=[production[pid] for pid in problems] if production and not refusal else None,
        production_version=production_version,
        min_improvement=min_improvement,
        alpha=alpha,
        skipped_reason=skipped_reason,
        refusal=refusal,
    )
