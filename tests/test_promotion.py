"""The promotion gate on constructed per-problem results whose p-values are worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlhf_core.pipeline.promotion import clears_gate, decide, decide_from_evaluation, match_production
from rlhf_core.stats import mcnemar_exact_p


def results(right: int, wrong: int) -> list[bool]:
    return [True] * right + [False] * wrong


def test_first_version_significantly_better_than_the_base_model_is_promoted():
    # 8 problems, all fixed, none broken: p = 2 * (1/2)^8 = 0.0078125
    decision = decide(candidate=results(8, 0), base=results(0, 8))
    assert decision.promote
    assert decision.baseline == "base_model"
    assert (decision.candidate_accuracy, decision.baseline_accuracy) == (1.0, 0.0)
    assert decision.comparison.p_value == pytest.approx(0.0078125)
    assert decision.reason.startswith("promoted: accuracy 1.0000 vs 0.0000 of the base model (no production "
                                      "version yet) on the same 8 problems: gain +1.0000, 95% CI [")
    assert "McNemar exact p = 0.007812 (8 fixed, 0 broken)" in decision.reason


def test_a_gain_within_the_noise_is_not_promoted_and_the_reason_says_so():
    # 100 problems; the candidate fixes 6 and breaks 2: +4 points, p = 2 * (1 + 8 + 28) / 2^8 = 0.2890625
    base = results(50, 50)
    candidate = [True] * 50 + [False] * 50
    for i in range(2):
        candidate[i] = False       # broken
    for i in range(50, 56):
        candidate[i] = True        # fixed
    decision = decide(candidate, base)
    assert decision.improvement == pytest.approx(0.04)
    assert not decision.promote
    assert decision.comparison.p_value == pytest.approx(74 / 256)
    # the interval (Newcombe's, tested on published examples in test_stats) straddles 0 and the reason quotes it
    low, high = decision.comparison.ci_low, decision.comparison.ci_high
    assert low < 0 < 0.04 < high
    assert decision.reason.startswith("not promoted: the gain is not significant, within the noise of 100 problems")
    assert f"gain +0.0400, 95% CI [{low:+.4f}, {high:+.4f}]" in decision.reason
    assert "p = 0.2891" in decision.reason


def test_production_is_the_baseline_once_there_is_one():
    # 20 problems: base 2 right, production 18 right, candidate 19 right (1 fixed vs production, p = 1)
    base = results(2, 18)
    production = results(18, 2)
    candidate = results(19, 1)
    decision = decide(candidate, base, production=production, production_version="3")
    assert not decision.promote
    assert decision.baseline == "production"
    assert decision.baseline_accuracy == pytest.approx(0.9)
    assert decision.comparison.p_value == 1.0
    assert "production version 3 on the same 20 problems" in decision.reason


def test_significant_but_below_the_margin_stays_out():
    # 200 problems, 12 fixed, 0 broken: p = 2 / 2^12 (significant), gain 0.06 < 0.10
    decision = decide(results(112, 88), results(100, 100), production=results(100, 100), min_improvement=0.10)
    assert decision.comparison.p_value == pytest.approx(2 / 4096)
    assert not decision.promote
    assert decision.reason.startswith("not promoted: improvement too small")
    assert decide(results(112, 88), results(100, 100), production=results(100, 100), min_improvement=0.06).promote


@pytest.mark.parametrize(
    ("fixed", "broken", "alpha", "promoted"),
    [
        (6, 0, 0.05, True),    # p = 2/64 = 0.03125
        (5, 0, 0.05, False),   # p = 2/32 = 0.0625
        (5, 0, 0.10, True),
        (6, 0, 0.01, False),
        (9, 1, 0.05, True),    # p = 2 * 11 / 1024 = 0.021484
        (8, 2, 0.05, False),   # p = 2 * 56 / 1024 = 0.109375
    ],
)
def test_significance_level_decides(fixed, broken, alpha, promoted):
    n = 40
    baseline = [False] * fixed + [True] * broken + [True] * 10 + [False] * (n - fixed - broken - 10)
    candidate = [True] * fixed + [False] * broken + [True] * 10 + [False] * (n - fixed - broken - 10)
    assert decide(candidate, results(0, n), production=baseline, alpha=alpha).promote is promoted


def test_a_p_value_equal_to_alpha_is_not_significant():
    # 5 fixed, 0 broken: p = 2 * (1/2)^5 = 0.0625 exactly, as is alpha; the rule is p < alpha
    decision = decide(results(5, 5), results(0, 10), alpha=0.0625)
    assert decision.comparison.p_value == 0.0625
    assert not decision.comparison.significant
    assert not decision.promote
    assert decision.reason.startswith("not promoted: the gain is not significant, within the noise of 10 problems")


def test_a_significantly_worse_candidate_is_not_promoted_and_the_reason_says_so():
    # 40 problems, production right on 30; the candidate breaks 8 of them and fixes none: gain -8/40 = -0.2,
    # McNemar on the 8 discordant problems p = 2 * (1/2)^8 = 0.0078125, significant, but the wrong way
    production = results(30, 10)
    candidate = results(22, 18)
    decision = decide(candidate, results(0, 40), production=production, production_version="4")
    assert decision.comparison.p_value == pytest.approx(0.0078125)
    assert (decision.comparison.fixed, decision.comparison.broken) == (0, 8)
    assert decision.improvement == pytest.approx(-0.2)
    assert not decision.promote
    assert decision.reason.startswith("not promoted: no improvement (accuracy 0.5500 vs 0.7500 of production "
                                      "version 4 on the same 40 problems: gain -0.2000")
    assert "(0 fixed, 8 broken)" in decision.reason
    # the same with no production yet (the base model is the baseline), and with a margin to clear
    assert not decide(candidate, production).promote
    assert not decide(candidate, production, min_improvement=0.05).promote


def test_a_tie_never_replaces_production():
    decision = decide(results(5, 5), results(0, 10), production=[False, True] * 5)
    assert not decision.promote
    assert decision.reason.startswith("not promoted: no improvement")


def test_two_evaluations_of_the_same_model_under_different_seeds_do_not_promote():
    """The same model sampled twice: each problem right with its own probability, independently."""
    skill = np.random.default_rng(0).uniform(0, 1, size=300)  # one model's per-problem chance of success
    promoted = 0
    for seed in range(200):
        first = np.random.default_rng(1000 + seed).uniform(size=300) < skill
        second = np.random.default_rng(5000 + seed).uniform(size=300) < skill
        promoted += decide(list(second), list(first), production=list(first)).promote
    # Under "no difference" McNemar's exact test at the two-sided level 0.05 rejects at most 5% of the time,
    # half of it on each side (the discordant counts are symmetric), and only the side where the candidate
    # gains promotes: at most 2.5% false promotions, 5 of 200 on average (the exact test is conservative,
    # its level on ~100 discordant problems is under the nominal one). The seeds are fixed, so this is exact.
    assert promoted <= 200 * 0.025
    first = np.random.default_rng(1).uniform(size=300) < skill
    second = np.random.default_rng(2).uniform(size=300) < skill
    assert not decide(list(second), list(first), production=list(first)).promote


def test_a_skipped_run_is_never_promoted():
    decision = decide(None, None, skipped_reason="the data is unchanged")
    assert not decision.promote
    assert decision.reason == "not promoted: training was skipped (the data is unchanged)"


def test_missing_results_are_explained():
    assert "has no per-problem results" in decide(None, results(1, 1)).reason
    assert "neither a production version nor a base model" in decide(results(1, 1), None).reason


def test_production_on_other_problems_is_refused_and_nothing_promoted():
    candidate = {"val_fingerprint": "abc123", "problems": {"s/0": True, "s/1": True}}
    same = {"val_fingerprint": "abc123", "problems": {"s/1": False, "s/0": True, "s/9": False}}
    assert match_production(candidate, same, "2") == ({"s/0": True, "s/1": False}, None)

    other = {"val_fingerprint": "fff999", "problems": {"s/0": False, "s/1": False}}
    matched, refusal = match_production(candidate, other, "2")
    assert matched is None
    assert "production version 2 was evaluated on other validation problems (fingerprint fff999 vs abc123 here)" in refusal
    decision = decide(results(50, 0), results(0, 50), refusal=refusal)
    assert not decision.promote and decision.baseline == "production"
    assert decision.reason == f"not promoted: cannot compare with production: {refusal}"

    assert "kept no per-problem evaluation results" in match_production(candidate, {"accuracy": 0.5}, "1")[1]


def test_production_scored_otherwise_is_refused_and_a_record_without_settings_is_compared():
    from rlhf_core.config import DataConfig
    from rlhf_core.pipeline.promotion import scoring_settings

    settings = scoring_settings("aaa111", DataConfig(max_response_length=256))
    assert settings == {"reward_sha256": "aaa111", "max_prompt_length": 512, "max_response_length": 256,
                        "truncation": "error"}  # DataConfig's defaults besides the budget given
    problems = {"s/0": True, "s/1": False}
    candidate = {"val_fingerprint": "abc123", "problems": problems, "scoring": settings}
    lenient = {**candidate, "scoring": scoring_settings("bbb222", DataConfig(max_response_length=512))}
    matched, refusal = match_production(candidate, lenient, "3")
    assert matched is None
    assert refusal.startswith("production version 3 was scored otherwise on these problems "
                              "(max_response_length, reward_sha256 changed since)")
    assert match_production(candidate, {**candidate}, "3") == (problems, None)
    older = {"val_fingerprint": "abc123", "problems": problems}  # kept before the settings were recorded
    assert match_production(candidate, older, "3") == (problems, None)
    # chat-template keywords render other prompts: recorded when set, and a difference refuses the pairing
    thinking = scoring_settings("aaa111", DataConfig(max_response_length=256,
                                                     apply_chat_template_kwargs={"enable_thinking": False}))
    assert thinking == {**settings, "apply_chat_template_kwargs": {"enable_thinking": False}}
    matched, refusal = match_production({**candidate, "scoring": thinking}, candidate, "3")
    assert matched is None and "apply_chat_template_kwargs" in refusal
    # how the policies ran: greedy responses in bfloat16 on a GPU are not float32's on the CPU
    gpu = scoring_settings("aaa111", DataConfig(max_response_length=256), dtype="bfloat16", device="cuda")
    cpu = scoring_settings("aaa111", DataConfig(max_response_length=256), dtype="float32", device="cpu")
    assert gpu == {**settings, "dtype": "bfloat16", "device": "cuda"}
    matched, refusal = match_production({**candidate, "scoring": cpu}, {**candidate, "scoring": gpu}, "3")
    assert matched is None and "(device, dtype changed since)" in refusal
    # the batch size (left padding of another width can flip a greedy answer): a record from before it was kept
    # pairs, one of another batch size does not
    batched = {**candidate, "scoring": {**settings, "batch_size": 64}}
    assert match_production(batched, candidate, "3") == (problems, None)
    assert match_production(candidate, batched, "3") == (problems, None)
    matched, refusal = match_production(batched, {**candidate, "scoring": {**settings, "batch_size": 32}}, "3")
    assert matched is None and "(batch_size changed since)" in refusal
    assert match_production(batched, {**candidate, "scoring": {**settings, "batch_size": 64}}, "3") == (problems, None)


@pytest.mark.parametrize("bad", [{"alpha": 0.0}, {"alpha": 1.0}, {"alpha": 1.2}, {"alpha": -0.05},
                                 {"min_improvement": -0.1}, {"min_improvement": float("nan")}])
def test_invalid_settings_are_rejected(bad):
    with pytest.raises(ValueError, match="alpha|min_improvement"):
        decide(results(5, 0), results(0, 5), **bad)


def test_decision_serialises_with_its_gain_interval_and_p_value():
    record = decide(results(8, 0), results(0, 8)).to_dict()
    assert record["promote"] is True
    assert record["improvement"] == pytest.approx(1.0)
    assert record["p_value"] == pytest.approx(2 / 256)
    assert (record["fixed"], record["broken"], record["n_compared"]) == (8, 0, 8)
    assert set(record) >= {"reason", "baseline", "baseline_accuracy", "min_improvement", "alpha", "gain_ci"}


def test_the_evaluate_steps_record_is_paired_by_problem_id():
    ids = [f"s/{i}" for i in range(10)]
    evaluation = {
        "problems": dict(zip(ids, results(9, 1))),                    # candidate
        "base_problems": dict(zip(ids, results(1, 9))),
        "production_results": dict(zip(reversed(ids), results(9, 1))),  # right on s/9 .. s/1, wrong on s/0
        "production_version": "4",
    }
    # against production: fixed s/0, broken s/9; 1 vs 1 discordant, p = 1
    decision = decide_from_evaluation(evaluation, "4")
    assert (decision.comparison.fixed, decision.comparison.broken, decision.comparison.p_value) == (1, 1, 1.0)
    assert not decision.promote and decision.baseline == "production"
    # no production version: against the base model, 8 fixed, 0 broken, p = 2 / 2^8
    first = decide_from_evaluation({**evaluation, "production_results": None, "production_version": None}, None)
    assert first.promote and first.comparison.p_value == pytest.approx(2 / 256)
    # production changed between evaluate and promote: refused
    moved = decide_from_evaluation(evaluation, "5")
    assert not moved.promote
    assert "production is version 5 but the evaluation was paired with version 4" in moved.reason
    # production archived between evaluate and promote (no production now): refused, not promoted against it
    archived = decide_from_evaluation({**evaluation, "production_results": dict(zip(ids, results(1, 9)))}, None)
    assert not archived.promote
    assert "production is no version but the evaluation was paired with version 4" in archived.reason


def test_a_version_promoted_by_another_run_meanwhile_turns_the_promotion_into_a_refusal():
    from types import SimpleNamespace

    from steps.promote import decide_against_production

    class Client:  # production as successive looks find it: none, then version 7 (another run promoted it)
        def __init__(self, *looks):
            self.looks = list(looks)

        def get_model_version(self, name, stage):
            version = self.looks.pop(0)
            if version is None:
                raise KeyError(name)
            return version

    ids = [f"s/{i}" for i in range(20)]
    evaluation = {"problems": dict.fromkeys(ids, True), "base_problems": dict.fromkeys(ids, False),
                  "production_version": None, "production_results": None}
    decision, production = decide_against_production(Client(None, None), "m", evaluation, 0.0, 0.05)
    assert decision.promote and production is None  # 20 fixed, none broken, against the base model
    seven = SimpleNamespace(name="7", id="v7")
    decision, production = decide_against_production(Client(None, seven), "m", evaluation, 0.0, 0.05)
    assert not decision.promote and production is seven
    assert "production is version 7 but the evaluation was paired with no production version" in decision.reason
    # version 4, the production the evaluation was paired with (and beaten), archived between the two looks
    four = SimpleNamespace(name="4", id="v4")
    against_four = {**evaluation, "production_version": "4", "production_results": dict.fromkeys(ids, False)}
    decision, production = decide_against_production(Client(four, four), "m", against_four, 0.0, 0.05)
    assert decision.promote and production is four
    decision, production = decide_against_production(Client(four, None), "m", against_four, 0.0, 0.05)
    assert not decision.promote and production is None
    assert "production is no version but the evaluation was paired with version 4" in decision.reason


def test_production_is_evaluated_from_its_checkpoint_where_its_stored_results_do_not_pair():
    from rlhf_core.pipeline.evaluate import EvalResult, pair_with_production

    candidate = {"val_fingerprint": "abc123", "problems": {"s/0": True, "s/1": True}}
    stored = {"val_fingerprint": "abc123", "problems": {"s/0": False, "s/1": True},
              "policy": {"model": "prod", "accuracy": 0.5, "n": 2, "mean_score": 0.5, "per_source": {},
                         "mean_response_length": 3.0}}
    fresh = EvalResult("prod", 0.5, 2, 0.5, {}, 3.0, problems=[{"id": "s/0", "correct": True},
                                                              {"id": "s/1", "correct": False}])
    evaluated = []

    def evaluate(path):
        evaluated.append(path)
        return fresh

    # stored results on these problems: used, the checkpoint untouched
    pairing = pair_with_production(candidate, "3", lambda: stored, lambda: "/ckpt", evaluate)
    assert (pairing.results, pairing.refusal, pairing.reevaluated, evaluated) == ({"s/0": False, "s/1": True}, None,
                                                                                  None, [])
    assert pairing.result.accuracy == 0.5
    # stored on other problems: the checkpoint is evaluated on the candidate's, and the record says why
    other = {**stored, "val_fingerprint": "fff999"}
    pairing = pair_with_production(candidate, "3", lambda: other, lambda: "/ckpt", evaluate)
    assert evaluated == ["/ckpt"] and pairing.results == {"s/0": True, "s/1": False} and pairing.refusal is None
    assert pairing.result is fresh
    assert pairing.reevaluated == "production version 3 was evaluated on other validation problems " \
                                  "(fingerprint fff999 vs abc123 here)"
    # evaluated on fewer problems (its own tokenizer made some prompts too long to keep): refused, naming them
    short = EvalResult("prod", 1.0, 1, 1.0, {}, 3.0, problems=[{"id": "s/1", "correct": True}])
    pairing = pair_with_production(candidate, "3", lambda: other, lambda: "/ckpt", lambda path: short)
    assert pairing.results is None and pairing.result is short
    assert pairing.refusal.startswith("production version 3 was evaluated on other validation problems (fingerprint "
                                      "fff999 vs abc123 here); its checkpoint, evaluated here, kept no result for 1 of "
                                      "the candidate's 2 problems (s/0): ")
    decision = decide_from_evaluation({"problems": candidate["problems"], "base_problems": {"s/0": False, "s/1": False},
                                       "production_version": "3", "production_results": pairing.results,
                                       "production_refusal": pairing.refusal}, production_version="3")
    assert not decision.promote and "kept no result for 1 of the candidate's 2 problems" in decision.reason
    # more problems than the candidate's: compared on the candidate's
    wide = EvalResult("prod", 0.5, 3, 0.5, {}, 3.0, problems=[{"id": f"s/{i}", "correct": i == 1} for i in range(3)])
    assert pair_with_production(candidate, "3", lambda: other, lambda: "/ckpt", lambda path: wide).results == {
        "s/0": False, "s/1": True}
    # no checkpoint, or one that cannot be evaluated: refused, saying so, and the run goes on
    assert pair_with_production(candidate, "3", lambda: other, None, evaluate).refusal.endswith(
        "; it has no checkpoint to evaluate here")

    def missing():
        raise FileNotFoundError("the artifact's files are gone")

    pairing = pair_with_production(candidate, "3", None, missing, evaluate)
    assert pairing.results is None and pairing.refusal == (
        "production version 3 kept no per-problem evaluation results to pair with; its checkpoint could not be "
        "evaluated here either (FileNotFoundError: the artifact's files are gone)")
    # a stored record that cannot be read counts as none: the checkpoint is evaluated, and the record says why
    pairing = pair_with_production(candidate, "3", missing, lambda: "/ckpt", evaluate)
    assert pairing.results == {"s/0": True, "s/1": False} and pairing.reevaluated == (
        "production version 3 kept no per-problem evaluation results to pair with (its evaluation record could "
        "not be read: FileNotFoundError: the artifact's files are gone)")


def test_a_record_fingerprinted_before_extra_info_entered_the_fingerprint_has_production_evaluated_again():
    """A record of the earlier rule (no val_fingerprint_version: 1) cannot say whether its problems were these, even
    with the digest equal by chance: production's checkpoint is evaluated once on the candidate's problems."""
    from rlhf_core.pipeline.evaluate import VAL_FINGERPRINT_VERSION, EvalResult, pair_with_production

    assert VAL_FINGERPRINT_VERSION == 2
    candidate = {"val_fingerprint": "abc123", "val_fingerprint_version": 2, "problems": {"s/0": True, "s/1": True}}
    earlier = {"val_fingerprint": "abc123", "problems": {"s/0": True, "s/1": True},
               "policy": {"model": "prod", "accuracy": 1.0, "n": 2, "mean_score": 1.0, "per_source": {},
                          "mean_response_length": 3.0}}
    results, refusal = match_production(candidate, earlier, "4")
    assert results is None and refusal == (
        "production version 4's evaluation record fingerprints its validation problems by another rule (version 1 "
        "vs 2 here; version 2 added each problem's extra_info), so it cannot tell whether they were these")
    fresh = EvalResult("prod", 0.5, 2, 0.5, {}, 3.0, problems=[{"id": "s/0", "correct": False},
                                                              {"id": "s/1", "correct": True}])
    pairing = pair_with_production(candidate, "4", lambda: earlier, lambda: "/ckpt", lambda path: fresh)
    assert (pairing.results, pairing.refusal, pairing.reevaluated) == ({"s/0": False, "s/1": True}, None, refusal)
    # a record of this rule pairs as before
    assert match_production(candidate, {**earlier, "val_fingerprint_version": 2}, "4") == (
        {"s/0": True, "s/1": True}, None)


def test_a_stage_and_a_promotion_record_that_disagree_are_named_and_ones_that_agree_are_not():
    from rlhf_core.pipeline.promotion import stage_disagreement

    promoted = {"promoted": True, "promotion": "done", "decision_reason": "promoted: ..."}
    assert stage_disagreement(True, promoted) is None
    assert stage_disagreement(False, promoted) is None  # promoted, then archived by a later promotion
    assert stage_disagreement(True, {"promoted": True}) is None  # recorded before promotions were marked done
    assert stage_disagreement(False, {"promoted": False}) is None  # refused
    assert stage_disagreement(False, {}) is None  # a run that failed before promote
    pending = {"promotion": "pending", "decision_reason": "promoted: ..."}
    assert stage_disagreement(True, pending).startswith("in production, but its promotion was not marked done")
    assert stage_disagreement(False, pending).startswith("promotion decided but not carried out")
    for unrecorded in ({}, {"promoted": False}):  # set by hand, or a refused version promoted outside promote
        assert stage_disagreement(True, unrecorded).startswith("in production, but no promotion is recorded on it")


def test_the_gate_promotes_a_candidate_no_better_than_its_baseline_at_most_alpha_over_2_of_the_time():
    """The p-value is two-sided and the gain must be positive: under "no difference" (each discordant problem fixed
    or broken with probability 1/2) the chance of promotion, summed exactly over the binomial, is at most alpha / 2."""
    for alpha in (0.05, 0.01, 0.2):
        for d in range(1, 121):
            chance = sum(math.comb(d, fixed) for fixed in range(d + 1)
                         if clears_gate((2 * fixed - d) / d, mcnemar_exact_p(fixed, d - fixed), 0.0, alpha)) / 2 ** d
            assert chance <= alpha / 2


def test_a_gate_of_a_whole_accuracy_or_more_is_refused_as_one_that_never_promotes():
    """min_improvement is a gain in accuracy (at most 1): 2 meant as "2 points" would refuse every candidate, and
    a boolean is no gain at all."""
    from rlhf_core.pipeline.promotion import check_gate

    check_gate(0.02, 0.05)
    check_gate(0, 0.05)
    for bad, reason in [(2, "a gain in accuracy, a fraction below 1"), (1.0, "a gain in accuracy"),
                        (True, "must be a finite number >= 0"), (float("nan"), "must be a finite number >= 0")]:
        with pytest.raises(ValueError, match=reason):
            check_gate(bad, 0.05)


def _resolved(*overrides: str) -> dict:
    from rlhf_core.config import load_config

    return load_config(["data.train_files=a/train.parquet", "data.val_files=a/test.parquet", *overrides],
                       config_file="configs/ppo_demo_cpu.yaml", notice=lambda _: None, validate=False).to_dict()


def test_a_run_resumed_as_a_failure_advises_fingerprints_as_its_config_and_others_as_before():
    """A pipeline run that failed is resumed with the overrides its error names (resume_mode=resume_path, the
    checkpoint, and after a reward fix allow_reward_code_change): it trains what its config trains, and the next
    retraining with that config on the same data must not train it again as a changed config."""
    import hashlib
    import json

    from rlhf_core.pipeline.promotion import config_fingerprint

    plain = _resolved()
    resumed = _resolved("trainer.resume_mode=resume_path", "trainer.resume_from_path=/runs/r-1/global_step_2",
                        "trainer.allow_reward_code_change=true", "reward_model.train.resume_mode=disable")
    assert config_fingerprint(resumed) == config_fingerprint(plain)
    # a config that sets no resume key fingerprints as versions recorded it before: the whole tree but the data paths
    data = {key: value for key, value in plain["data"].items() if key not in ("train_files", "val_files")}
    recorded = hashlib.sha256(json.dumps({**plain, "data": data}, sort_keys=True, default=str).encode()).hexdigest()
    assert config_fingerprint(plain) == recorded
    assert config_fingerprint(_resolved("trainer.seed=7")) != recorded  # what is trained still counts
