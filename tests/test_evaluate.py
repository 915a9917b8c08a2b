"""Policy evaluation on a tiny random model: the cap, the fingerprint, every problem kept, sampled
metrics, the report, bad input; and two evaluations of one model under different seeds."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import itertools
import json
import math
import re
import statistics
import sys

import pandas as pd
import pytest

from rlhf_core.config import DataConfig, ValKwargsConfig
from rlhf_core.data.dataset import DataError
from rlhf_core.pipeline.evaluate import (
    NoticesOnce,
    NotRightOrWrong,
    changed_problems,
    check_right_or_wrong,
    evaluate_policy,
    evaluation_html,
    per_problem_table,
)
from rlhf_core.pipeline.promotion import decide


def digit_first(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str[:1].isdigit() else 0.0


def first_character(data_source, solution_str, ground_truth, extra_info=None):
    """digit_first that also says what each response answers: its first character (None when empty)."""
    return {"score": digit_first(data_source, solution_str, ground_truth), "pred": solution_str[:1] or None}


def even_index(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if extra_info["index"] % 2 == 0 else 0.0  # right or wrong by the problem, whatever the answer


Z95 = 1.959963984540054  # two-sided 95% normal quantile: evaluate_policy reports 95% Wilson intervals


def wilson(right, n, z=Z95):
    # the textbook form in counts: (x + z^2/2 +- z sqrt(x (n - x) / n + z^2/4)) / (n + z^2)
    centre, spread = right + z * z / 2, z * math.sqrt(right * (n - right) / n + z * z / 4)
    return max(0.0, (centre - spread) / (n + z * z)), min(1.0, (centre + spread) / (n + z * z))


def majority(texts, right):
    # the answer most responses give (first_character's: the first character), a tie to the one given first;
    # that response's correctness; no answer: wrong
    answers = [text[:1] or None for text in texts]
    counts = {}
    for answer in answers:
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
    if not counts:
        return 0.0
    winner = next(answer for answer in answers if counts.get(answer) == max(counts.values()))
    return right[answers.index(winner)]


def expected_sampled(scored):
    """mean@n, best@n and maj@n per data source from the (source, problem, response) triples scored, in order,
    each response right by digit_first's rule."""
    by_source = {}
    for source, problem, text in scored:
        by_source.setdefault(source, {}).setdefault(problem, []).append(text)
    expected = {}
    for source, problems in by_source.items():
        right = {problem: [1.0 if text[:1].isdigit() else 0.0 for text in texts] for problem, texts in problems.items()}
        expected[source] = {
            "problems": {problem: sum(values) / len(values) for problem, values in right.items()},
            "mean": sum(map(sum, right.values())) / sum(map(len, right.values())),  # every problem has n responses
            "best": sum(max(values) for values in right.values()) / len(right),
            "worst": sum(min(values) for values in right.values()) / len(right),
            "spread": sum(statistics.pstdev(values) for values in right.values()) / len(right),
            "vote": sum(majority(problems[problem], values) for problem, values in right.items()) / len(right),
            # the vote of each pair of a problem's responses (in their order), averaged over the pairs
            "vote2": sum(statistics.mean(majority([problems[problem][i] for i in pair], [values[i] for i in pair])
                                         for pair in itertools.combinations(range(len(values)), 2))
                         for problem, values in right.items()) / len(right),
        }
    return expected


@functools.cache
def _setup(root):
    from pathlib import Path

    from rlhf_core.data.synthetic import build_dataset
    from rlhf_core.models.toy import random_toy_model

    root = Path(root)
    model = random_toy_model(root / "model", n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    data = build_dataset(root / "data", n_train=8, n_test=40, seed=0, max_ops=1)
    frame = pd.read_parquet(data["test"])  # two data sources, 30 and 10 problems
    frame["data_source"] = ["synthetic/a"] * 30 + ["synthetic/b"] * 10
    frame.to_parquet(root / "val.parquet", index=False)
    return model, root / "val.parquet"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return _setup(str(tmp_path_factory.mktemp("evaluate")))


DATA = DataConfig(max_prompt_length=320, max_response_length=4)


def test_a_capped_evaluation_keeps_each_source_share_and_every_problem(setup):
    model, val = setup
    result = evaluate_policy(model, str(val), DATA, reward_fn=digit_first, batch_size=7, max_problems=8)
    assert (result.n, result.total_problems) == (8, 40)
    sources = [row["data_source"] for row in result.problems]
    assert sources.count("synthetic/a") == 6 and sources.count("synthetic/b") == 2
    assert result.accuracy == sum(row["correct"] for row in result.problems) / 8
    assert all(row["correct"] == (row["response"][:1].isdigit()) for row in result.problems)
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)  # the published 95% interval of 5/10
    right = sum(row["response"][:1].isdigit() for row in result.problems)
    assert result.interval == pytest.approx(wilson(right, 8))
    again = evaluate_policy(model, str(val), DATA, reward_fn=digit_first, batch_size=64, max_problems=8)
    assert again.val_fingerprint == result.val_fingerprint  # same cap and seed: the same problems
    assert [row["response"] for row in again.problems] == [row["response"] for row in result.problems]
    other = evaluate_policy(model, str(val), DATA, reward_fn=even_index, max_problems=8, sample_seed=1)
    assert other.val_fingerprint != result.val_fingerprint  # the reward is not in the fingerprint, the problems are
    right = sum(row["index"] % 2 == 0 for row in other.problems)
    assert 0 < right < 8  # an accuracy strictly inside (0, 1): every term of the interval counts
    assert other.accuracy == right / 8 and other.interval == pytest.approx(wilson(right, 8))


def test_sampled_metrics_are_named_by_data_source_where_reward_fn_key_routes_the_reward(setup, tmp_path):
    """As in training, and in verl: the val-core metrics name the data_source column, not data.reward_fn_key's."""
    model, val = setup
    frame = pd.read_parquet(val)
    frame["reward_fn"] = "synthetic/arithmetic"
    frame.to_parquet(tmp_path / "routed.parquet", index=False)
    result = evaluate_policy(model, str(tmp_path / "routed.parquet"), dataclasses.replace(DATA, reward_fn_key="reward_fn"),
                             reward_fn=digit_first, max_problems=8, val_kwargs=ValKwargsConfig(do_sample=True, n=2))
    assert {key for key in result.sampled if key.startswith("val-core/") and "/acc/mean@" in key} == {
        "val-core/synthetic/a/acc/mean@2", "val-core/synthetic/b/acc/mean@2"}
    # the sample and the accuracy by source go by the same names: 30 and 10 of the 40 rows, 6 and 2 of 8 (one seed
    # drew 8 and 0 where the sample was stratified by the routing column, the same for every row)
    sources = [row["metric_source"] for row in result.problems]
    assert (sources.count("synthetic/a"), sources.count("synthetic/b")) == (6, 2)
    assert result.per_source == {
        source: sum(row["correct"] for row in result.problems if row["metric_source"] == source) / count
        for source, count in (("synthetic/a", 6), ("synthetic/b", 2))}


def test_the_accuracy_by_source_is_each_sources_share_right(setup):
    """Right by the problem (extra_info's index a multiple of 3), whatever the model answers: of indices 0-29
    (synthetic/a) 0, 3, ..., 27 are right, 10 of 30; of 30-39 (synthetic/b) 30, 33, 36, 39, 4 of 10."""
    model, val = setup

    def every_third(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 if extra_info["index"] % 3 == 0 else 0.0

    result = evaluate_policy(model, str(val), DATA, reward_fn=every_third)
    assert result.n == 40
    assert result.accuracy == pytest.approx(14 / 40)
    assert result.per_source == {"synthetic/a": pytest.approx(10 / 30), "synthetic/b": pytest.approx(4 / 10)}


def test_problems_sharing_an_id_are_refused_before_any_generation(setup, tmp_path):
    model, val = setup
    frame = pd.read_parquet(val)
    pd.concat([frame, frame]).to_parquet(tmp_path / "twice.parquet", index=False)  # (one file: not named twice)
    with pytest.raises(ValueError, match="40 problem ids .* are shared by several rows, e.g. synthetic/a/0"):
        evaluate_policy(model, str(tmp_path / "twice.parquet"), DATA, reward_fn=digit_first)


def test_an_evaluation_shows_the_problems_done_against_the_problems_it_evaluates(setup, capsys):
    """An evaluation said nothing until its result: GSM8K's 1319 problems on a CPU are minutes of silence. It now
    counts the problems done against the problems evaluated (the --max-problems sample: 8 of the 40), in batches
    of 3 (3, 6, 8), and the sampled pass likewise (problems, not its n responses each); off a terminal as lines."""
    model, val = setup
    capsys.readouterr()
    evaluate_policy(model, str(val), DATA, reward_fn=digit_first, batch_size=3, max_problems=8,
                    val_kwargs=ValKwargsConfig(do_sample=True, temperature=1.0, n=2))
    err = capsys.readouterr().err  # (transformers' own "Loading weights" bar comes first)
    assert [line.split(" [")[0] for line in err.split("\n") if "evaluation" in line] == [
        "evaluation:   0% 0/8", "evaluation: 100% 8/8",
        "sampled evaluation (n=2):   0% 0/8", "sampled evaluation (n=2): 100% 8/8"], err


def test_a_labelled_evaluation_names_its_model_in_its_load_and_its_bars(setup, capsys, monkeypatch):
    """The pipeline's evaluate step evaluates the base model, the trained policy (from a temporary folder ZenML
    makes) and the production version one after the other, and its log said "evaluation" and "Loading weights"
    alike for each. A label names the model in the load's lines and in both evaluation bars."""
    from transformers.utils import logging as hf_logging

    model, val = setup
    monkeypatch.setattr(hf_logging, "_tqdm_active", True)  # (transformers' bars on, whatever an earlier test left)
    capsys.readouterr()
    evaluate_policy(model, str(val), DATA, reward_fn=digit_first, batch_size=4, max_problems=4, label="trained policy",
                    val_kwargs=ValKwargsConfig(do_sample=True, temperature=1.0, n=2))
    lines = [line.split(":   0%")[0] for line in capsys.readouterr().err.split("\n") if ":   0%" in line]
    assert lines == [f"Loading weights (trained policy: {model})", "evaluation (trained policy)",
                     "sampled evaluation (trained policy, n=2)"], lines


def test_sampled_metrics_come_with_val_kwargs_and_greedy_stays_the_headline(setup):
    model, val = setup
    scored = []

    def recorded(data_source, solution_str, ground_truth, extra_info=None):
        scored.append((data_source, extra_info["index"], solution_str))
        return first_character(data_source, solution_str, ground_truth, extra_info)

    greedy = evaluate_policy(model, str(val), DATA, reward_fn=digit_first, max_problems=10)
    sampled = evaluate_policy(model, str(val), DATA, reward_fn=recorded, max_problems=10,
                              val_kwargs=ValKwargsConfig(do_sample=True, temperature=1.0, n=3), seed=5)
    assert sampled.accuracy == greedy.accuracy
    # the greedy headline is scored first, one response per problem; then the 3 samples of each
    assert scored[:10] == [(row["data_source"], row["index"], row["response"]) for row in greedy.problems]
    assert len(scored) == 10 + 3 * 10
    expected = expected_sampled(scored[10:])
    metrics = sampled.sampled
    for source, count in (("synthetic/a", 8), ("synthetic/b", 2)):
        rows = [row for row in sampled.problems if row["data_source"] == source]
        assert len(rows) == count == len(expected[source]["problems"])
        assert [row["mean@3"] for row in rows] == pytest.approx([expected[source]["problems"][r["index"]] for r in rows])
        for name, key in (("mean", "mean@3"), ("best", "best@3/mean"), ("vote", "maj@3/mean")):
            assert metrics[f"val-core/{source}/acc/{key}"] == pytest.approx(expected[source][name]), (source, key)
    # the samples tell the metrics apart: a prompt right only sometimes, a vote won by a right answer
    assert any(e["best"] > e["mean"] for e in expected.values()) and any(e["vote"] > 0 for e in expected.values())
    assert not greedy.sampled


def test_two_evaluations_of_one_model_under_different_seeds_are_not_promoted(setup):
    model, val = setup
    runs = [evaluate_policy(model, str(val), DATA, reward_fn=digit_first, seed=seed,
                            val_kwargs=ValKwargsConfig(do_sample=True, temperature=1.0, n=1)) for seed in (1, 2)]
    first, second = ([row["mean@1"] == 1.0 for row in run.problems] for run in runs)
    assert first != second  # the seeds do change the answers ...
    decision = decide(second, first, production=first)
    assert not decision.promote  # ... but not enough to call it progress
    assert "p = " in decision.reason


def test_report_shows_intervals_and_what_was_fixed_and_broken(setup):
    model, val = setup
    base = evaluate_policy(model, str(val), DATA, reward_fn=digit_first, max_problems=6)
    candidate = evaluate_policy(model, str(val), DATA, reward_fn=lambda **kw: 1.0 - digit_first(**kw),
                                max_problems=6)
    table = per_problem_table(candidate, base)
    assert list(table["candidate_correct"]) == [not v for v in table["base_correct"]]
    changed = changed_problems(table, "base", limit=2)
    assert changed["n_fixed"] == int((~table["base_correct"]).sum())
    assert changed["n_broken"] == int(table["base_correct"].sum())
    assert len(changed["fixed"]) == min(2, changed["n_fixed"])
    page = evaluation_html({"base model": base, "trained policy": candidate}, changed=changed)
    low, high = candidate.interval
    assert f"<td>{candidate.accuracy:.2%}</td><td>[{low:.1%}, {high:.1%}]</td><td>6</td>" in page
    assert f"fixed {changed['n_fixed']}, broke {changed['n_broken']}" in page
    for item in changed["fixed"]:
        assert f"<td>fixed</td><td>{item['problem_id']}</td>" in page


def test_a_problem_without_a_ground_truth_is_shown_as_such_not_as_the_text_none():
    """A custom reward's prompts may have no ground truth: the table, its CSV and the report showed "None", the
    text a real answer "None" has too."""
    from rlhf_core.pipeline.evaluate import EvalResult

    def result(correct: list[bool]) -> EvalResult:
        truths = [None, "None", 7]  # none; the answer "None"; a number
        problems = [{"id": f"s/{i}", "data_source": "s", "index": i, "correct": right, "ground_truth": truth,
                     "prompt": f"q{i}", "response": f"r{i}"} for i, (truth, right) in enumerate(zip(truths, correct))]
        return EvalResult("m", sum(correct) / 3, 3, 0.0, {}, 2.0, examples=problems, val_fingerprint="f",
                          problems=problems)

    base, candidate = result([False, False, True]), result([True, True, False])
    table = per_problem_table(candidate, base)
    for stored in (table, pd.read_parquet(io.BytesIO(table.to_parquet()))):  # the artifact is stored as parquet
        assert stored["ground_truth"].isna().tolist() == [True, False, False]
        assert stored["ground_truth"].tolist()[1:] == ["None", "7"]
    csv = pd.read_csv(io.StringIO(table.to_csv(index=False)), keep_default_na=False)
    assert csv["ground_truth"].tolist() == ["", "None", "7"]
    changed = changed_problems(table, "base")
    assert [item["ground_truth"] for item in changed["fixed"]] == [None, "None"]  # JSON null in the metadata
    assert json.dumps(changed["fixed"][0]["ground_truth"]) == "null"
    page = evaluation_html({"base model": base, "trained policy": candidate}, changed=changed)
    marker = "<td class='no-truth'><em>(no ground truth)</em></td>"
    assert f"<td>fixed</td><td>s/0</td><td>s</td>{marker}<td><pre>r0</pre></td>" in page
    assert "<td>fixed</td><td>s/1</td><td>s</td><td>None</td><td><pre>r1</pre></td>" in page
    assert "<td>broken</td><td>s/2</td><td>s</td><td>7</td><td><pre>r2</pre></td>" in page
    assert f"<td><pre>q0</pre></td><td><pre>r0</pre></td>{marker}</tr>" in page  # the examples
    assert "<td><pre>q1</pre></td><td><pre>r1</pre></td><td>None</td></tr>" in page
    # and the lineage's text of the version, from the step's metadata
    from rlhf_core.pipeline.lineage import _changed_lines

    lines = _changed_lines({"compared_with": "base", **changed})
    assert lines[1:] == ["        fixed s/0 (no ground truth): 'r0'", "        fixed s/1 (answer None): 'r1'",
                         "        broken s/2 (answer 7): 'r2'"]


def test_a_validation_set_without_ground_truths_is_graded_by_a_custom_reward_only(setup, tmp_path):
    """A custom reward grades prompts without a ground truth in training (it gets None); the evaluation refused
    them even so, after the pipeline had trained on them. The built-in rules cannot grade them."""
    model, val = setup
    frame = pd.read_parquet(val)
    frame["reward_model"] = [{"style": "rule", "ground_truth": None}] * len(frame)
    frame.to_parquet(tmp_path / "no_truth.parquet", index=False)
    frame.drop(columns=["reward_model"]).to_parquet(tmp_path / "prompts_alone.parquet", index=False)
    with pytest.raises(DataError, match=r"row 0: reward_model.ground_truth is missing"):
        evaluate_policy(model, str(tmp_path / "no_truth.parquet"), DATA)  # the built-in rule
    with pytest.raises(DataError, match=r"column\(s\) \['reward_model'\] missing"):
        evaluate_policy(model, str(tmp_path / "prompts_alone.parquet"), DATA)
    seen = []

    def digit_first_seen(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(ground_truth)
        return digit_first(data_source, solution_str, ground_truth)

    with_truth = evaluate_policy(model, str(val), DATA, reward_fn=digit_first, max_problems=10)
    for name in ("no_truth.parquet", "prompts_alone.parquet"):
        seen.clear()
        result = evaluate_policy(model, str(tmp_path / name), DATA, reward_fn=digit_first_seen, max_problems=10)
        assert seen == [None] * 10
        # the same problems and greedy responses as with the ground truths, right where they start with a digit
        assert [(p["id"], p["response"]) for p in result.problems] == \
            [(p["id"], p["response"]) for p in with_truth.problems]
        assert [p["correct"] for p in result.problems] == [p["response"][:1].isdigit() for p in result.problems]
        assert result.accuracy == sum(p["response"][:1].isdigit() for p in result.problems) / 10


def test_a_problem_the_reward_leaves_ungraded_is_refused_not_counted_wrong(setup):
    """acc NaN (no verdict) on greedy responses was counted wrong: 0.5 on 10 problems half of which had no verdict,
    where the sampled mean@n, which leaves them out, said 1.0; and a gain over another model was thinned out."""
    model, val = setup

    def ungraded_odd(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.0, "acc": math.nan} if extra_info["index"] % 2 else {"score": 1.0, "acc": 1.0}

    with pytest.raises(ValueError, match=r"no verdict \(acc NaN\) on \d+ problem"):
        evaluate_policy(model, str(val), DATA, reward_fn=ungraded_odd, max_problems=10)


def test_a_partial_acc_is_refused_not_counted_as_a_problem_solved(setup):
    """A reward's acc of 0.2 on every response (partial credit, which the trainer's validation averages to 0.2)
    was counted right, as any acc above 0: the evaluation said 100% and paired every problem as solved. An acc of
    False/True (or 0/1) still counts as it says: right on the even indices, 20 of the 40 problems."""
    model, val = setup

    def fifth(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.2, "acc": 0.2}

    def even(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5, "acc": extra_info["index"] % 2 == 0}

    with pytest.raises(ValueError, match=r"an acc other than 0 or 1 on 10 problem\(s\), e.g. \S+ \(acc 0\.2\)"):
        evaluate_policy(model, str(val), DATA, reward_fn=fifth, max_problems=10)
    indices = pd.read_parquet(val)["extra_info"].map(lambda extra: extra["index"])
    result = evaluate_policy(model, str(val), DATA, reward_fn=even)
    assert (result.n, result.accuracy) == (40, sum(index % 2 == 0 for index in indices) / 40) == (40, 0.5)


def test_the_right_or_wrong_check_counts_a_problem_with_several_responses_once():
    """The dry run checks every validation response, several to a problem where val_kwargs.n > 1: a problem is
    counted once, with its first such acc; 0, 1, False and True pass; the reward is named as the caller says."""
    check_right_or_wrong([("s/0", 0.0), ("s/1", 1.0), ("s/2", float(False)), ("s/3", float(True))])
    verdicts = [("s/0", 0.2), ("s/0", 0.4), ("s/1", 1.0), ("s/2", 0.5), ("s/2", 0.0)]
    with pytest.raises(NotRightOrWrong, match=re.escape("the reward function 'f' gave an acc other than 0 or 1 on "
                                                        "2 problem(s), e.g. s/0 (acc 0.2), s/2 (acc 0.5): ")):
        check_right_or_wrong(verdicts, "the reward function 'f'")
    with pytest.raises(NotRightOrWrong, match=re.escape("the reward gave no verdict (acc NaN) on 1 problem(s), e.g. "
                                                        "s/1: ")):
        check_right_or_wrong([("s/0", 1.0), ("s/1", math.nan), ("s/1", math.nan)])


def test_the_evaluate_command_says_a_reward_without_a_verdict_in_one_line(setup, tmp_path, capsys):
    """A custom reward giving acc NaN (no verdict) or 0.2 (partial credit) ended the command in a traceback with
    exit status 1; it is the reward's result at fault, said in one line with exit status 2, as a reward function
    returning what is not a score is."""
    from rlhf_core.cli.pipeline import evaluate

    model, val = setup
    short = ["--max-response-length", "2", "--max-prompt-length", "320", "--max-problems", "4"]
    for acc, said in (("float('nan')", "the reward gave no verdict (acc NaN) on 4 problem(s)"),
                      ("0.2", "the reward gave an acc other than 0 or 1 on 4 problem(s)")):
        reward = tmp_path / "reward.py"
        reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                          f"    return {{'score': 0.2, 'acc': {acc}}}\n")
        assert evaluate([str(model), str(val), *short, "--custom-reward", str(reward)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        [line] = [line for line in err.splitlines() if line.startswith("error:")]  # (after the weights' loading bar)
        assert line.startswith(f"error: {said}, e.g. "), err


def test_trainer_validation_logs_sampled_metrics_under_verl_names(setup, tmp_path):
    import json

    from rlhf_core.config import load_config
    from rlhf_core.main_ppo import build_trainer

    model, val = setup
    reward, log = tmp_path / "digit_first.py", tmp_path / "scored.jsonl"
    reward.write_text("import json\n"  # digit_first that also writes down every response it scores, in order
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      f"    with open({str(log)!r}, 'a') as out:\n"
                      "        out.write(json.dumps([data_source, extra_info['index'], solution_str]) + '\\n')\n"
                      "    return {'score': 1.0 if solution_str[:1].isdigit() else 0.0, 'pred': solution_str[:1] or None}\n")
    cfg = load_config([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={val}", f"data.val_files={val}",
        "data.train_batch_size=8", "data.max_prompt_length=320", "data.max_response_length=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.rollout.val_kwargs.n=3", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false", "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=1", "trainer.device=cpu", "trainer.val_before_train=false",
        f"trainer.default_local_dir={tmp_path / 'out'}", "trainer.logger=[file]",
        f"custom_reward_function.path={reward}", "custom_reward_function.name=compute_score",
    ], notice=lambda _notice: None)
    trainer = build_trainer(cfg)
    log.unlink(missing_ok=True)  # only what validation scores
    metrics = trainer.validate()
    scored = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
    assert len(scored) == 3 * 40  # val_kwargs.n responses for every prompt
    expected = expected_sampled(scored)
    for source, prompts in (("synthetic/a", 30), ("synthetic/b", 10)):
        want = expected[source]
        assert len(want["problems"]) == prompts
        for name, key in (("mean", "mean@3"), ("best", "best@3/mean"), ("vote", "maj@3/mean")):
            assert metrics[f"val-core/{source}/acc/{key}"] == pytest.approx(want[name]), (source, key)
        assert metrics[f"val-aux/{source}/reward/mean@3"] == pytest.approx(want["mean"])  # reward is 0/1 right
        assert metrics[f"val-aux/{source}/acc/worst@3/mean"] == pytest.approx(want["worst"])
        assert metrics[f"val-aux/{source}/acc/std@3"] == pytest.approx(want["spread"])
        assert metrics[f"val-aux/{source}/reward/std@3"] == pytest.approx(want["spread"])
        # the reward is the 0/1 verdict here, so its best and worst response per prompt are the accuracy's
        assert metrics[f"val-aux/{source}/reward/best@3/mean"] == pytest.approx(want["best"])
        assert metrics[f"val-aux/{source}/reward/worst@3/mean"] == pytest.approx(want["worst"])
        assert metrics[f"val-aux/{source}/acc/maj@2/mean"] == pytest.approx(want["vote2"])  # every pair's vote
        for name, share in (("best@3", want["best"]), ("maj@3", want["vote"]), ("worst@3", want["worst"])):
            # per-prompt 0/1: sqrt(p (1 - p) / m)
            assert metrics[f"val-aux/{source}/acc/{name}/std"] == pytest.approx(math.sqrt(share * (1 - share) / prompts))
    # the samples tell the metrics apart: a prompt right only sometimes, a vote won by a right answer
    assert any(e["best"] > e["mean"] for e in expected.values()) and any(e["vote"] > 0 for e in expected.values())
    # and std@3 of acc and reward, worst@3 with its std, the reward's best and worst, best@2 and worst@2 (each
    # with its std) of acc and reward, and maj@2 with its std
    assert len(metrics) == 2 * 25


def test_the_fingerprint_covers_every_message_of_a_prompt():
    """Two problems alike in their last message but not in their system message are other problems."""
    import hashlib

    from rlhf_core.pipeline.evaluate import val_fingerprint

    question = {"role": "user", "content": "What is 2 + 3?"}
    plain = [{"id": "s/0", "prompt": question["content"], "ground_truth": "5",
              "messages": [{"role": "system", "content": "Answer after ####."}, question]}]
    terse = [{**plain[0], "messages": [{"role": "system", "content": "Answer in one word."}, question]}]
    assert val_fingerprint(plain) != val_fingerprint(terse)
    # worked out by hand: the problem's line, [id, messages, ground truth, extra_info] as sorted-key JSON (no
    # extra_info given: null)
    line = '["s/0", [{"content": "Answer after ####.", "role": "system"}, {"content": "What is 2 + 3?", ' \
           '"role": "user"}], "5", null]'
    assert val_fingerprint(plain) == hashlib.sha256(line.encode()).hexdigest()


def test_the_fingerprint_covers_extra_info_and_tells_a_missing_ground_truth_from_the_text_none():
    """A reward reads extra_info (a rubric, test cases): two sets that differ there alone are graded otherwise, and
    a missing ground truth (None) is not the answer "None". The digest is worked out here from the documented
    rendering: each problem as the sorted-key JSON line [id, messages, ground truth, extra_info], NumPy values as
    their Python ones, the lines sorted and joined by newlines, SHA-256."""
    import hashlib

    import numpy as np

    from rlhf_core.pipeline.evaluate import val_fingerprint

    question = [{"role": "user", "content": "Is 7 prime?"}]
    problems = [
        {"id": "s/1", "prompt": "Is 7 prime?", "messages": question, "ground_truth": None,
         "extra_info": {"index": np.int64(1), "rubric": "yes", "cases": np.array([2, 3])}},
        {"id": "s/0", "prompt": "Is 7 prime?", "messages": question, "ground_truth": "None",
         "extra_info": {"rubric": "no", "index": 0}},
    ]
    lines = ['["s/0", [{"content": "Is 7 prime?", "role": "user"}], "None", {"index": 0, "rubric": "no"}]',
             '["s/1", [{"content": "Is 7 prime?", "role": "user"}], null, '
             '{"cases": [2, 3], "index": 1, "rubric": "yes"}]']
    expected = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    assert val_fingerprint(problems) == expected
    assert val_fingerprint(problems[::-1]) == expected  # the order the problems came in does not count
    # NumPy scalars and arrays hash as the Python values they hold
    plain = [{**problems[0], "extra_info": {"index": 1, "rubric": "yes", "cases": [2, 3]}}, problems[1]]
    assert val_fingerprint(plain) == expected
    relaxed = [{**problems[0], "extra_info": {**problems[0]["extra_info"], "rubric": "maybe"}}, problems[1]]
    assert val_fingerprint(relaxed) != expected
    truth_text = [{**problems[0], "ground_truth": "None"}, problems[1]]  # null and the text "None" differ
    assert val_fingerprint(truth_text) != expected


def test_validation_sets_differing_in_extra_info_alone_do_not_pair(setup, tmp_path):
    """Production graded against a strict rubric in extra_info, the candidate against a relaxed one, with the same
    ids, prompts and ground truths: pairing their results would measure the rubric's change as a gain."""
    from rlhf_core.pipeline.promotion import match_production

    model, val = setup
    frame = pd.read_parquet(val).head(6)
    for name, strict in (("strict", True), ("relaxed", False)):
        frame.assign(extra_info=[{**extra, "strict": strict} for extra in frame["extra_info"]]).to_parquet(
            tmp_path / f"{name}.parquet", index=False)

    def rubric(data_source, solution_str, ground_truth, extra_info=None):
        return 0.0 if extra_info["strict"] else 1.0

    old = evaluate_policy(model, str(tmp_path / "strict.parquet"), DATA, reward_fn=rubric)
    new = evaluate_policy(model, str(tmp_path / "relaxed.parquet"), DATA, reward_fn=rubric)
    assert [p["id"] for p in old.problems] == [p["id"] for p in new.problems]
    assert (old.accuracy, new.accuracy) == (0.0, 1.0)
    assert old.val_fingerprint != new.val_fingerprint
    assert [p["extra_info"]["strict"] for p in new.problems] == [False] * 6  # each row keeps what it was graded by

    def record(result):
        return {"val_fingerprint": result.val_fingerprint, "problems": {p["id"]: p["correct"] for p in result.problems}}

    results, refusal = match_production(record(new), record(old), "1")
    assert results is None and refusal.startswith("production version 1 was evaluated on other validation problems")


def test_the_evaluate_command_renders_prompts_with_the_chat_template_kwargs_given(setup, monkeypatch, capsys):
    """A policy trained with data.apply_chat_template_kwargs (Qwen3's enable_thinking: false) could only be
    evaluated on prompts rendered without them: the command had no way to give them."""
    from rlhf_core.cli.pipeline import evaluate
    from rlhf_core.pipeline import evaluate as module

    class Stop(Exception):
        pass

    seen = []

    def evaluated(model, val_files, data, **kwargs):  # what the evaluation was given, before any model loads
        seen.append(data.apply_chat_template_kwargs)
        raise Stop

    monkeypatch.setattr(module, "evaluate_policy", evaluated)
    model, val = setup
    with pytest.raises(Stop):
        evaluate([str(model), str(val), "--chat-template-kwargs", '{"enable_thinking": false, "effort": "low"}'])
    assert seen == [{"enable_thinking": False, "effort": "low"}]
    for text, said in (('{"max_length": 8}', "max_length is an argument of apply_chat_template, not a variable of "
                                             "the chat template: every prompt is rendered as the trainer renders it"),
                       ("[1]", "a JSON object of keywords is needed")):
        with pytest.raises(SystemExit) as exit_:
            evaluate([str(model), str(val), "--chat-template-kwargs", text])
        assert exit_.value.code == 2 and f"argument --chat-template-kwargs: {said}" in capsys.readouterr().err
    assert len(seen) == 1


def test_the_evaluate_command_refuses_bad_numbers_and_takes_a_custom_reward(setup, tmp_path, capsys):
    """Before any model loads, a count below 1 is an argparse error; data sources without a built-in rule name the
    option that grades them; with it, the file's function grades every problem (right on even indices: 20 of 40),
    and the --html report says when they were a --max-problems sample of the file's."""
    import pandas as pd

    from rlhf_core.cli.pipeline import evaluate

    model, val = setup
    for flag in ("--max-problems", "--batch-size", "--max-response-length"):
        with pytest.raises(SystemExit) as exit_:
            evaluate([str(model), str(val), flag, "0"])
        assert exit_.value.code == 2 and f"{flag} 0 must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # said before the evaluation, not after it
        evaluate([str(model), str(val), "--html", str(tmp_path / "no" / "such" / "report.html")])
    assert exit_.value.code == 2 and "the folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # numpy's generator takes no negative seed
        evaluate([str(model), str(val), "--max-problems", "4", "--sample-seed", "-1"])
    assert exit_.value.code == 2 and "--sample-seed -1 must be >= 0" in capsys.readouterr().err
    short = ["--max-response-length", "2", "--max-prompt-length", "320"]
    assert evaluate([str(model), str(val), *short]) == 2
    err = capsys.readouterr().err
    assert "no reward function for data_source 'synthetic/a'" in err and "(here: --custom-reward FILE.py)" in err
    assert "Traceback" not in err
    reward = tmp_path / "even.py"
    reward.write_text("def graded(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1.0 if extra_info['index'] % 2 == 0 else 0.0\n")
    indices = [info["index"] for info in pd.read_parquet(val)["extra_info"]]
    assert sorted(indices) == list(range(40))
    assert evaluate([str(model), str(val), *short, "--custom-reward", str(reward),
                     "--custom-reward-name", "graded"]) == 0
    assert capsys.readouterr().out.startswith("accuracy 50.00% ")
    # the report says the problems were a sample of the file's, as the printed line does (its table gives n alone)
    report = tmp_path / "report.html"
    assert evaluate([str(model), str(val), *short, "--custom-reward", str(reward), "--custom-reward-name", "graded",
                     "--max-problems", "10", "--sample-seed", "3", "--html", str(report)]) == 0
    assert " on 10 of 40 prompts " in capsys.readouterr().out
    half = Z95 * math.sqrt(0.25 / 10)  # the normal interval's half-width at 50%: 31.0%
    assert (f"<p>Evaluated on 10 of 40 problems (--max-problems, stratified by data source, --sample-seed 3): an "
            f"accuracy near 50% is known to +-{half:.1%} (95%).</p>") in report.read_text()
    assert f"{half:.1%}" == "31.0%"
    assert evaluate([str(model), str(val), *short, "--custom-reward", str(reward)]) == 2  # no compute_score in it
    err = capsys.readouterr().err  # the way on is this command's option, not training's key
    assert "error: --custom-reward: " in err and "functions it defines: graded" in err
    assert "Set --custom-reward-name to one of them." in err and "custom_reward_function" not in err
    # keyword arguments reach the function as reward_kwargs do in training: scaled by 0.5, no answer earns full marks
    scaled = tmp_path / "scaled.py"
    scaled.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
                      "    return scale * (1.0 if extra_info['index'] % 2 == 0 else 0.0)\n")
    assert evaluate([str(model), str(val), *short, "--custom-reward", str(scaled), "--reward-kwarg", "scale=0.5"]) == 0
    assert capsys.readouterr().out.startswith("accuracy 0.00% ")
    assert evaluate([str(model), str(val), *short, "--custom-reward", str(scaled), "--reward-kwarg", "scale=1"]) == 0
    assert capsys.readouterr().out.startswith("accuracy 50.00% ")
    assert evaluate([str(model), str(val), *short, "--custom-reward", str(scaled), "--reward-kwarg", "scal=1"]) == 2
    err = capsys.readouterr().err
    assert "error: --custom-reward: " in err and "'scal'" in err
    assert "--reward-kwarg {'scal': 1} do not fit" in err and "custom_reward_function" not in err
    for argv, said in ((["--reward-kwarg", "scale=1"], "name that file"),
                       (["--custom-reward", str(scaled), "--reward-kwarg", "scale"], "write KEY=VALUE")):
        with pytest.raises(SystemExit) as exit_:
            evaluate([str(model), str(val), *short, *argv])
        assert exit_.value.code == 2 and said in capsys.readouterr().err
    # a reward that raises: exit 2 (as rlhf-ppo's), one line that names the function, not a traceback
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    raise KeyError('answer')\n")
    assert evaluate([str(model), str(val), *short, "--custom-reward", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == ("error: reward function 'compute_score' failed on sample 0 (data_source="
                                    "'synthetic/a', extra_info.index=0): KeyError: 'answer'")
    assert "Traceback" not in err


def test_a_policy_whose_architecture_is_code_in_its_folder_evaluates_only_when_trusted(setup, tmp_path, capsys):
    """A model folder naming its classes in config.json's auto_map (actor_rollout_ref.model.trust_remote_code trains
    it): evaluated with trust_remote_code, as the evaluate step passes it and the command's --trust-remote-code asks,
    its greedy responses are the plain model's (its class is the same architecture under another name); without it,
    an error says which switch runs the code."""
    import json
    import shutil

    from rlhf_core.cli.pipeline import evaluate
    from rlhf_core.models.loading import ModelError

    model, val = setup
    custom = tmp_path / "custom_model"
    shutil.copytree(model, custom)
    (custom / "toy_custom.py").write_text(
        "from transformers import LlamaConfig, LlamaForCausalLM\n\n\n"
        "class ToyCustomConfig(LlamaConfig):\n    model_type = 'toy_custom'\n\n\n"
        "class ToyCustomForCausalLM(LlamaForCausalLM):\n    config_class = ToyCustomConfig\n")
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="toy_custom", architectures=["ToyCustomForCausalLM"],
                  auto_map={"AutoConfig": "toy_custom.ToyCustomConfig",
                            "AutoModelForCausalLM": "toy_custom.ToyCustomForCausalLM"})
    (custom / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"holds model code of its own .* set actor_rollout_ref\.model\."
                                         r"trust_remote_code=true \(the evaluate command's --trust-remote-code\)"):
        evaluate_policy(custom, str(val), DATA, reward_fn=digit_first, max_problems=6)
    plain = evaluate_policy(model, str(val), DATA, reward_fn=digit_first, max_problems=6)
    trusted = evaluate_policy(custom, str(val), DATA, reward_fn=digit_first, max_problems=6, trust_remote_code=True)
    assert [p["response"] for p in trusted.problems] == [p["response"] for p in plain.problems]
    assert trusted.accuracy == plain.accuracy
    reward = tmp_path / "digit_first.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1.0 if solution_str[:1].isdigit() else 0.0\n")
    command = [str(custom), str(val), "--max-prompt-length", "320", "--max-response-length", "4", "--max-problems",
               "6", "--custom-reward", str(reward)]
    assert evaluate(command) == 2
    err = capsys.readouterr().err
    assert f"error: {custom} holds model code of its own" in err and "Traceback" not in err
    assert evaluate([*command, "--trust-remote-code"]) == 0
    assert capsys.readouterr().out.startswith(f"accuracy {plain.accuracy:.2%} ")


def test_the_evaluate_command_imports_external_lib_first(setup, tmp_path, capsys, monkeypatch):
    """A policy whose architecture a module registers with transformers (actor_rollout_ref.model.external_lib trains
    it): --external-lib imports that module before the model loads, and its responses are the plain model's; a
    module that does not import is named as the option's."""
    import json
    import shutil
    import sys

    from rlhf_core.cli.pipeline import evaluate

    model, val = setup
    registered = tmp_path / "registered_model"
    shutil.copytree(model, registered)
    config = json.loads((registered / "config.json").read_text())
    config.update(model_type="toy_registered", architectures=["ToyRegisteredForCausalLM"])
    (registered / "config.json").write_text(json.dumps(config))
    library = tmp_path / "lib"
    library.mkdir()
    (library / "toy_registry.py").write_text(
        "from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM\n\n\n"
        "class ToyRegisteredConfig(LlamaConfig):\n    model_type = 'toy_registered'\n\n\n"
        "class ToyRegisteredForCausalLM(LlamaForCausalLM):\n    config_class = ToyRegisteredConfig\n\n\n"
        "AutoConfig.register('toy_registered', ToyRegisteredConfig)\n"
        "AutoModelForCausalLM.register(ToyRegisteredConfig, ToyRegisteredForCausalLM)\n")
    monkeypatch.syspath_prepend(str(library))
    monkeypatch.delitem(sys.modules, "toy_registry", raising=False)
    reward = tmp_path / "digit_first.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1.0 if solution_str[:1].isdigit() else 0.0\n")
    command = [str(registered), str(val), "--max-prompt-length", "320", "--max-response-length", "4",
               "--max-problems", "6", "--custom-reward", str(reward)]
    assert evaluate(command) == 2  # transformers knows no toy_registered until the module registers it
    assert (f"error: {registered}: transformers does not know its model type; a module that registers it is imported "
            "with actor_rollout_ref.model.external_lib (the evaluate command's --external-lib MODULE)"
            ) in capsys.readouterr().err
    assert evaluate([*command, "--external-lib", "no_such_registry"]) == 2
    assert "error: --external-lib: module 'no_such_registry' cannot be imported" in capsys.readouterr().err
    assert "toy_registry" not in sys.modules
    assert evaluate([*command, "--external-lib", "toy_registry"]) == 0
    plain = evaluate_policy(model, str(val), DATA, reward_fn=digit_first, max_problems=6)
    assert capsys.readouterr().out.startswith(f"accuracy {plain.accuracy:.2%} ")


def test_the_report_draws_accuracies_of_none_and_all_right():
    """0 of 40 and 40 of 40: the plot's error bars were a rounding error below 0 there, which matplotlib refused
    (the report failed after training had finished); an interval end a hair inside the value is drawn too."""
    from rlhf_core.pipeline.evaluate import EvalResult
    from rlhf_core.stats import wilson_interval

    none = EvalResult("base model", 0.0, 40, 0.0, {}, 3.0, interval=wilson_interval(0, 40))
    every = EvalResult("trained policy", 1.0, 40, 1.0, {}, 3.0, interval=wilson_interval(40, 40))
    page = evaluation_html({"base model": none, "trained policy": every})
    assert "<td>0.00%</td><td>[0.0%, 8.8%]</td><td>40</td>" in page
    assert "<td>100.00%</td><td>[91.2%, 100.0%]</td><td>40</td>" in page
    hair = EvalResult("base model", 0.0, 40, 0.0, {}, 3.0, interval=(6.9e-18, 0.0876))
    assert "<img" in evaluation_html({"base model": hair})


def test_the_evaluate_command_refuses_a_reward_model_as_the_policy(setup, tmp_path, capsys):
    """A sequence-classification model (what train-rm exports) was loaded as a causal LM with a new random head and
    scored 0%, exit 0; it is refused before any weights load, as itself and as the export beside a checkpoint."""
    import json

    from rlhf_core.cli.pipeline import evaluate

    model, val = setup
    for folder in (tmp_path / "rm", tmp_path / "run" / "huggingface"):
        folder.mkdir(parents=True)
        config = json.loads((model / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"],
                                                        "num_labels": 1}))
        (folder / "model.safetensors").write_bytes(b"never read")
    for given, folder in ((tmp_path / "rm", tmp_path / "rm"), (tmp_path / "run", tmp_path / "run" / "huggingface")):
        assert evaluate([str(given), str(val)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {folder} holds a reward/classification model (one score per sequence): "
                              "LlamaForSequenceClassification, not a causal language model;"), err
        assert "Traceback" not in err


def test_the_evaluate_command_names_its_data_argument_and_says_what_a_file_is(setup, tmp_path, capsys):
    """Errors about the positional data files named data.val_files, which the command has not; a file of preference
    pairs was reported as lacking reward_model; a file whose prompts are in another column names it and the option
    that reads it (which then evaluates)."""
    from rlhf_core.cli.pipeline import evaluate

    model, val = setup
    missing = tmp_path / "missing.parquet"
    assert evaluate([str(model), str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: val_files: {missing} does not exist") and "data.val_files" not in err

    frame = pd.read_parquet(val)
    pairs = frame.drop(columns=["reward_model"]).assign(chosen="#### 1", rejected="#### 2")
    pairs.to_parquet(tmp_path / "pairs.parquet")
    assert evaluate([str(model), str(tmp_path / "pairs.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: val_files: column(s) ['reward_model'] missing; found ['data_source', 'prompt', "
                          "'ability', 'extra_info', 'chosen', 'rejected']: this is preference data "), err
    assert "data.val_files" not in err

    frame.rename(columns={"prompt": "question"}).to_parquet(tmp_path / "question.parquet")
    assert evaluate([str(model), str(tmp_path / "question.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: val_files: column(s) ['prompt'] missing;") and \
        err.rstrip().endswith("the prompts look to be in 'question': set --prompt-key question"), err
    reward = tmp_path / "digit.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1.0\n")
    assert evaluate([str(model), str(tmp_path / "question.parquet"), "--prompt-key", "question", "--max-problems",
                     "4", "--max-response-length", "2", "--max-prompt-length", "320", "--custom-reward",
                     str(reward)]) == 0
    assert capsys.readouterr().out.startswith("accuracy 100.00% (95% interval [51.0%, 100.0%]) on 4 of 40 prompts")


def test_the_accuracy_figure_shows_each_data_source_where_there_are_several():
    from rlhf_core.pipeline.evaluate import EvalResult, accuracy_figure

    base = EvalResult("b", 0.4, 50, 0.4, {"openai/gsm8k": 0.5, "math": 0.3}, 3.0, interval=(0.27, 0.54))
    policy = EvalResult("p", 0.6, 50, 0.6, {"openai/gsm8k": 0.75, "math": 0.45}, 3.0, interval=(0.46, 0.72))
    overall, by_source = accuracy_figure({"base model": base, "trained policy": policy}).axes
    assert [bar.get_height() for bar in overall.patches] == [0.4, 0.6]
    assert by_source.get_title() == "by data source"
    assert [tick.get_text() for tick in by_source.get_xticklabels()] == ["math", "openai/gsm8k"]
    bars = sorted(by_source.patches, key=lambda bar: bar.get_x())  # math: base, policy; then gsm8k: base, policy
    assert [round(bar.get_height(), 6) for bar in bars] == [0.3, 0.45, 0.5, 0.75]
    assert [text.get_text() for text in by_source.get_legend().get_texts()] == ["base model", "trained policy"]
    single = EvalResult("b", 0.4, 50, 0.4, {"math": 0.4}, 3.0, interval=(0.27, 0.54))
    assert len(accuracy_figure({"base model": single}).axes) == 1  # one source: the overall panel says it all


def test_the_accuracy_figure_gives_each_models_n_where_they_were_evaluated_on_different_numbers_of_problems():
    """Production's checkpoint evaluated in the run that kept 38 of the candidate's 40 problems is drawn beside
    the others (the report's note says why it is not compared): the title said n=40 of every bar."""
    from rlhf_core.pipeline.evaluate import EvalResult, accuracy_figure

    base = EvalResult("b", 0.4, 40, 0.4, {"math": 0.4}, 3.0, interval=(0.26, 0.56))
    production = EvalResult("q", 0.5, 38, 0.5, {"math": 0.5}, 3.0, interval=(0.35, 0.65))
    policy = EvalResult("p", 0.6, 40, 0.6, {"math": 0.6}, 3.0, interval=(0.45, 0.74))
    [axes] = accuracy_figure({"base model": base, "production (version 1)": production,
                              "trained policy": policy}).axes
    assert axes.get_title() == "validation accuracy (n under each model)"
    assert [tick.get_text() for tick in axes.get_xticklabels()] == [
        "base model\n(n=40)", "production\n(version 1)\n(n=38)", "trained\npolicy\n(n=40)"]
    [axes] = accuracy_figure({"base model": base, "trained policy": policy}).axes
    assert axes.get_title() == "validation accuracy (n=40)"
    assert [tick.get_text() for tick in axes.get_xticklabels()] == ["base model", "trained\npolicy"]


def test_the_models_names_under_the_accuracy_bars_do_not_run_into_one_another_beside_the_sources_panel():
    """The evaluate step's three models (base, production, trained) over two data sources: each name under its bar
    stands clear of the next one (level text, so its drawn box is the text's)."""
    from rlhf_core.pipeline.evaluate import EvalResult, _png, accuracy_figure

    sources = {"openai/gsm8k": 0.4, "synthetic/arithmetic": 0.5}
    results = {name: EvalResult("m", 0.45, 200, 0.45, sources, 10.0, interval=(0.38, 0.52))
               for name in ("base model", "production (version 12)", "trained policy")}
    figure = accuracy_figure(results)
    _png(figure)  # (lays the figure out)
    overall = figure.axes[0]
    assert [label.get_rotation() for label in overall.get_xticklabels()] == [0.0, 0.0, 0.0]
    assert [label.get_text().split() for label in overall.get_xticklabels()] == \
        [["base", "model"], ["production", "(version", "12)"], ["trained", "policy"]]
    boxes = [label.get_window_extent(figure.canvas.get_renderer()) for label in overall.get_xticklabels()]
    assert all(left.x1 < right.x0 for left, right in zip(boxes, boxes[1:]))


def test_the_evaluate_command_on_a_model_whose_weights_give_nan_says_so_in_one_line_naming_it(setup, tmp_path,
                                                                                              capsys):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from rlhf_core.cli.pipeline import evaluate

    model, val = setup
    broken = tmp_path / "nan_model"
    shutil.copytree(model, broken)
    weights = load_file(broken / "model.safetensors")
    save_file({name: torch.full_like(value, math.nan) if value.is_floating_point() else value
               for name, value in weights.items()}, broken / "model.safetensors", metadata={"format": "pt"})
    reward = tmp_path / "zero.py"  # (the data's sources have no built-in rule, refused before the model loads)
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    assert evaluate([str(broken), str(val), "--max-problems", "4", "--max-response-length", "4",
                     "--custom-reward", str(reward)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [said] = [line for line in err.splitlines() if line.startswith("error:")]  # (after the weights' loading bar)
    assert said == (f"error: evaluating {broken} failed: the policy's logits held NaN (or inf) at response token 0 "
                    "of rows 0, 1, 2, 3, so there is no distribution to sample from: its weights hold NaN or inf, or "
                    "give them (a checkpoint saved from a diverged run)"), err  # (not a training run's advice)


def test_the_evaluate_command_grades_with_a_batch_reward_function_as_training_calls_one(setup, tmp_path, capsys):
    """A reward function of whole batches (reward_model.reward_manager=batch in training) could not grade an
    evaluation: the command called it once a response. With --reward-manager batch it is called once a batch of
    --batch-size prompts with lists, as training calls it: 40 problems in batches of 16 are 3 batches (16, 16, 8),
    and a function that marks the first response of each batch right gives 3 of 40, 7.50%; one that marks the
    problems whose index is a multiple of 4 right gives 10 of 40 (0, 4, ..., 36), 25.00%."""
    from rlhf_core.cli.pipeline import evaluate
    from rlhf_core.config import load_config
    from rlhf_core.rewards import custom_reward_fn

    model, val = setup
    firsts = tmp_path / "firsts.py"
    firsts.write_text("def compute_score(data_sources, solution_strs, ground_truths, extra_infos):\n"
                      "    return [1.0 if i == 0 else 0.0 for i in range(len(solution_strs))]\n")
    fourths = tmp_path / "fourths.py"
    fourths.write_text("def by_index(data_sources, solution_strs, ground_truths, extra_infos, every=2):\n"
                       "    return [{'score': 1.0 if info['index'] % every == 0 else 0.0} for info in extra_infos]\n")
    short = ["--max-response-length", "2", "--max-prompt-length", "320", "--batch-size", "16"]
    assert evaluate([str(model), str(val), *short, "--custom-reward", str(firsts), "--reward-manager", "batch"]) == 0
    low, high = wilson(3, 40)
    assert capsys.readouterr().out.startswith(f"accuracy 7.50% (95% interval [{low:.1%}, {high:.1%}]) on 40 of 40 ")
    assert evaluate([str(model), str(val), *short, "--custom-reward", str(fourths), "--custom-reward-name", "by_index",
                     "--reward-kwarg", "every=4", "--reward-manager", "batch"]) == 0
    assert capsys.readouterr().out.startswith("accuracy 25.00% ")
    # called once a response, it is refused before any model loads, with the option that calls it once a batch
    assert evaluate([str(model), str(val), *short, "--custom-reward", str(firsts)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "(a function of whole batches: --reward-manager batch)" in err, err
    with pytest.raises(SystemExit) as exit_:
        evaluate([str(model), str(val), "--reward-manager", "batch"])
    assert exit_.value.code == 2 and "name that file" in capsys.readouterr().err
    # the pipeline's evaluate step: the function training's config names, as training loads it
    cfg = load_config([f"custom_reward_function.path={firsts}", "reward_model.reward_manager=batch"], validate=False)
    result = evaluate_policy(model, str(val), DATA, batch_size=16, reward_fn=custom_reward_fn(cfg))
    assert (result.n, result.accuracy) == (40, 3 / 40)
    assert [p["correct"] for p in result.problems] == [i % 16 == 0 for i in range(40)]


def test_the_evaluate_command_names_its_own_options_in_what_it_says_of_the_data(setup, tmp_path, capsys):
    """Its notices and errors named training's keys (data.max_prompt_length, data.truncation, data.val_files, ...),
    which the command does not take: they name its options, or say what it does in their place."""
    from rlhf_core.cli.pipeline import evaluate

    model, val = setup
    short = ["--max-problems", "2", "--max-response-length", "2"]
    assert evaluate([str(model), str(val), *short, "--max-prompt-length", "20"]) == 2  # (no rule for synthetic/a)
    [notice] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")]
    assert notice.startswith(f"notice: val_files: truncation cut 40 of 40 prompts longer than --max-prompt-length "
                             f"(20 tokens) to that length (first: {val} row 0), keeping their ends: "), notice
    frame = pd.read_parquet(val)
    answered = frame.assign(prompt=[[*p, {"role": "assistant", "content": "#### 1"}] for p in frame["prompt"]])
    answered.to_parquet(tmp_path / "answered.parquet", index=False)
    assert evaluate([str(model), str(tmp_path / "answered.parquet"), *short, "--max-prompt-length", "320"]) == 2
    [notice] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")]
    assert notice.startswith("notice: val_files: 40 of 40 prompts end with an assistant turn"), notice
    pd.concat([frame, frame]).to_parquet(tmp_path / "twice.parquet", index=False)
    frame.assign(reward_model=[{"style": "rule", "ground_truth": None}] * 40).to_parquet(tmp_path / "open.parquet")
    unrouted = frame.copy()
    unrouted.loc[3, "data_source"] = None
    unrouted.to_parquet(tmp_path / "unrouted.parquet", index=False)
    said = {"twice.parquet": "error: val_files: 40 problem ids (data_source/extra_info.index, else the row in its "
                             "file) are shared by several rows, e.g. ",
            "open.parquet": f"error: {tmp_path / 'open.parquet'} row 0: reward_model.ground_truth is missing",
            "unrouted.parquet": f"error: {tmp_path / 'unrouted.parquet'} row 3: 'data_source' (the column that "
                                "routes the row to its reward function) is null; give every row its data source"}
    for name, start in said.items():
        assert evaluate([str(model), str(tmp_path / name), *short]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith(start), err
        assert "data.val_files" not in err and "data.reward_fn_key" not in err
        if name == "open.parquet":
            assert "evaluate with a custom reward function (here: --custom-reward FILE.py)" in err, err


def test_the_evaluate_command_refuses_an_empty_file_naming_its_argument(setup, tmp_path, capsys):
    """An empty parquet was named data.val_files, which the command has not."""
    from rlhf_core.cli.pipeline import evaluate

    model, val = setup
    empty = tmp_path / "empty.parquet"
    pd.read_parquet(val).iloc[:0].to_parquet(empty, index=False)
    assert evaluate([str(model), str(empty)]) == 2
    assert capsys.readouterr().err == f"error: val_files: {empty} has no rows; give files with prompts\n"


def test_the_evaluate_command_refuses_a_model_without_its_tokenizer_in_one_line(setup, tmp_path, capsys):
    """A model folder without its tokenizer files ended in transformers' traceback (about slow tokenizers and
    sentencepiece), exit 1."""
    import shutil

    from rlhf_core.cli.pipeline import evaluate

    model, val = setup
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model / name, bare / name)
    assert evaluate([str(bare), str(val), "--max-problems", "2"]) == 2
    assert capsys.readouterr().err == (
        f"error: model: {bare} holds no tokenizer files (looked for tokenizer.json, tokenizer_config.json, "
        "tokenizer.model, vocab.json): the prompts are encoded and the responses decoded with the policy's "
        "tokenizer; copy the tokenizer files of the model it was trained from into it\n")


def test_the_evaluate_command_says_how_it_takes_several_files_where_it_is_given_a_folder(setup, tmp_path, capsys):
    """A folder in place of the data files was answered with training's list syntax (val_files=[a.parquet,...]),
    which the command does not read: it takes the files one after another."""
    from rlhf_core.cli import main
    from rlhf_core.cli.pipeline import evaluate

    model, val = setup
    folder = tmp_path / "split"
    folder.mkdir()
    (folder / "part.parquet").write_bytes(val.read_bytes())
    assert main(["evaluate", str(model), str(folder)]) == 2
    assert capsys.readouterr().err == (f"error: val_files: {folder} is a folder; name its parquet files (several, one "
                                       "after another: rlhf evaluate MODEL a.parquet b.parquet); it holds "
                                       "part.parquet\n")
    # under its python -m path (its function called itself), the hint names that, as its usage does
    assert evaluate([str(model), str(folder)]) == 2
    assert capsys.readouterr().err == (f"error: val_files: {folder} is a folder; name its parquet files (several, one "
                                       "after another: python -m rlhf_core.pipeline.evaluate MODEL a.parquet "
                                       "b.parquet); it holds part.parquet\n")


def test_notices_once_leaves_out_a_notice_already_said_and_passes_the_rest_as_it_comes():

    out = io.StringIO()
    once = NoticesOnce()
    with contextlib.redirect_stderr(out):
        with once.said():
            sys.stderr.write("notice: data cut 3 of 4 prompts\n")
            sys.stderr.write("\r 50%|##   ")  # a progress bar's frame: no newline, passed at once
            assert out.getvalue().endswith("\r 50%|##   ")
            sys.stderr.write("\r100%|#### \n")
        with once.said():
            sys.stderr.write("noti")  # held: it could still be a notice
            assert out.getvalue().endswith("\r100%|#### \n")
            sys.stderr.write("ce: data cut 3 of 4 prompts\nnotice: data cut 2 of 4 prompts\n")
            sys.stderr.write("a line\nnot")
        sys.stderr.write("|")  # after the block: the held 'not' was written as it left
    assert out.getvalue() == ("notice: data cut 3 of 4 prompts\n\r 50%|##   \r100%|#### \n"
                              "notice: data cut 2 of 4 prompts\na line\nnot|")


def test_the_pipeline_says_a_notice_of_the_data_once_for_the_models_it_evaluates(setup, capfd):
    """Each model's evaluation reads the data (base, policy, production's checkpoint): the truncation notice
    was said once for each."""
    from rlhf_core.config import DataConfig


    model, val = setup
    once = NoticesOnce()
    for _ in range(3):
        with once.said():
            evaluate_policy(model, str(val), DataConfig(max_prompt_length=20, truncation="left"), max_new_tokens=2,
                            max_problems=2, reward_fn=lambda *args, **kwargs: 0.0)
    notices = [line for line in capfd.readouterr().err.splitlines() if line.startswith("notice:")]
    assert len(notices) == 1 and "cut 40 of 40 prompts longer than data.max_prompt_length" in notices[0], notices


def test_rewording_leaves_a_key_inside_a_path_or_a_word_as_it_is():
    """A training key inside a path (a folder a sweep named data.max_prompt_length=20/) or a file's name was put as
    the command's option, naming a file that is not on disk."""
    from rlhf_core.pipeline.evaluate import reworded

    names = {"data.val_files": "val_files", "data.max_prompt_length": "--max-prompt-length"}
    said = ("notice: data.val_files: 3 prompts longer than data.max_prompt_length (20 tokens) (first: "
            "runs/data.max_prompt_length=20/val.parquet row 0; also my_data.val_files.parquet, "
            "data.max_prompt_length=20/b.parquet and old.data.val_files)")
    assert reworded(said, names) == (
        "notice: val_files: 3 prompts longer than --max-prompt-length (20 tokens) (first: "
        "runs/data.max_prompt_length=20/val.parquet row 0; also my_data.val_files.parquet, "
        "data.max_prompt_length=20/b.parquet and old.data.val_files)")


def test_the_evaluate_command_names_a_path_holding_a_training_key_as_it_is_on_disk(setup, tmp_path, capsys):
    """A data folder or a reward file under a folder named by a training key was named with the command's option
    in its place (sweep/--max-prompt-length=20), a path that is not there."""
    from rlhf_core.cli.pipeline import evaluate

    model, val = setup
    folder = tmp_path / "sweep" / "data.max_prompt_length=20"
    folder.mkdir(parents=True)
    (folder / "part.parquet").write_bytes(val.read_bytes())
    assert evaluate([str(model), str(folder)]) == 2
    assert capsys.readouterr().err == (f"error: val_files: {tmp_path}/sweep/data.max_prompt_length=20 is a folder; "
                                       "name its parquet files (several, one after another: python -m "
                                       "rlhf_core.pipeline.evaluate MODEL a.parquet b.parquet); it holds "
                                       "part.parquet\n")
    rewards = tmp_path / "rewards" / "reward_model.reward_manager=batch"
    rewards.mkdir(parents=True)
    (rewards / "score.py").write_text("def compute_score(data_sources, solution_strs, ground_truths, extra_infos):\n"
                                      "    return [0.0] * len(solution_strs)\n")
    assert evaluate([str(model), str(val), "--custom-reward", str(rewards / "score.py")]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: --custom-reward: 'compute_score' in '{tmp_path}/rewards/reward_model.reward_manager=batch/score.py' "
        "cannot be called as the reward manager calls it for each response (a function of whole batches: "
        "--reward-manager batch), fn(")


def test_the_evaluate_command_names_its_custom_reward_option_for_a_file_without_ground_truths(setup, tmp_path,
                                                                                              capsys):
    """A file without the reward_model column was told that prompts without one evaluate with a custom reward
    function, without the option that gives one (a row without a ground truth was told it)."""
    from rlhf_core.cli.pipeline import evaluate

    model, val = setup
    pd.read_parquet(val).drop(columns=["reward_model"]).to_parquet(tmp_path / "open.parquet", index=False)
    assert evaluate([str(model), str(tmp_path / "open.parquet")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: val_files: column(s) ['reward_model'] missing"), err
    assert "evaluate with a custom reward function (here: --custom-reward FILE.py)" in err, err


def test_the_evaluate_command_says_a_file_named_twice_is_named_twice(setup, tmp_path, capsys, monkeypatch):
    """The same file named twice (as itself and through another path to it) was refused for problem ids shared by
    several rows, with the advice to give every row its own extra_info.index: its rows are numbered right."""
    from rlhf_core.cli.pipeline import evaluate

    model, val = setup
    monkeypatch.chdir(val.parent)
    assert evaluate([str(model), str(val), f"./{val.name}", "--max-problems", "2"]) == 2
    assert capsys.readouterr().err == (f"error: val_files: {val.resolve()} is named 2 times; its rows would be "
                                       "evaluated as many times over: name each file once\n")


def test_the_evaluate_command_refuses_a_source_without_a_rule_before_the_model_loads(setup, capsys, monkeypatch):
    """Data sources without a built-in rule (and no --custom-reward) were refused at the first batch's scoring,
    once the model had loaded and generated (a 7B model's minutes), as 'sample 0: ...'."""
    from rlhf_core.cli.pipeline import evaluate
    from rlhf_core.models import loading

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    model, val = setup
    monkeypatch.setattr(loading, "load_actor", no_load)
    assert evaluate([str(model), str(val), "--max-prompt-length", "320"]) == 2
    assert capsys.readouterr().err.startswith("error: val_files: no reward function for data_source 'synthetic/a'; "
                                              "built-in sources are ")


def test_the_evaluate_command_points_to_batch_calls_only_for_a_function_of_whole_batches(setup, tmp_path, capsys):
    """A function of each response without a parameter the calls give (ground_truth) was told of --reward-manager
    batch, which refuses it again (no data_sources); a function of whole batches is still told of it."""
    from rlhf_core.cli.pipeline import evaluate

    model, val = setup
    short = tmp_path / "short.py"
    short.write_text("def compute_score(data_source, solution_str):\n    return 1.0\n")
    assert evaluate([str(model), str(val), "--custom-reward", str(short)]) == 2
    assert capsys.readouterr().err == (
        f"error: --custom-reward: 'compute_score' in '{short}' cannot be called as the reward manager calls it for "
        "each response, fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...): got an unexpected "
        "keyword argument 'ground_truth'\n")
    whole = tmp_path / "whole.py"
    whole.write_text("def compute_score(data_sources, solution_strs, ground_truths, extra_infos):\n"
                     "    return [1.0] * len(solution_strs)\n")
    assert evaluate([str(model), str(val), "--custom-reward", str(whole)]) == 2
    assert "for each response (a function of whole batches: --reward-manager batch), fn(" in capsys.readouterr().err


def test_the_kl_curve_is_the_kl_per_token_as_the_guard_reads_it():
    """actor/kl_loss is summed as loss_agg_mode says (per response with seq-mean-token-sum): drawn beside the
    per-token actor/ppo_kl it read some hundred times higher; its per-token mean is drawn where it was logged."""
    from rlhf_core.pipeline.evaluate import curve_panels

    logged = [{"step": 1, "actor/ppo_kl": 0.01, "actor/kl_loss": 1.6, "actor/kl_loss_token_mean": 0.1,
               "val-core/a/acc/mean@1": 0.5}]
    assert dict(curve_panels(logged))["KL"] == ["actor/ppo_kl", "actor/kl_loss_token_mean"]
    older = [{"step": 1, "actor/ppo_kl": 0.01, "actor/kl_loss": 0.1}]  # a run from before the per-token key
    assert dict(curve_panels(older))["KL"] == ["actor/ppo_kl", "actor/kl_loss"]
    assert dict(curve_panels(logged))["validation accuracy"] == ["val-core/a/acc/mean@1"]


def test_the_training_curves_mark_whole_steps_on_their_axes():
    """A short run's curves were ticked at 0.25 or 0.5 of a training step, which no step is."""
    from rlhf_core.pipeline.evaluate import training_curves_figure

    history = [{"step": 0, "val-core/a/acc/mean@1": 0.25},
               {"step": 1, "critic/score/mean": 0.1, "actor/ppo_kl": 0.001},
               {"step": 2, "critic/score/mean": 0.3, "actor/ppo_kl": 0.002, "val-core/a/acc/mean@1": 0.5}]
    figure = training_curves_figure(history)
    figure.canvas.draw()
    for axes in figure.axes:
        ticks = [tick for tick in axes.get_xticks() if axes.get_xlim()[0] <= tick <= axes.get_xlim()[1]]
        assert ticks and all(float(tick).is_integer() for tick in ticks), (axes.get_title(), ticks)
    assert [axes.get_title() for axes in figure.axes] == ["reward", "KL", "validation accuracy"]


# ----------------------------------------------------------------------------- a checkpoint's own settings

# The tiny run's settings (tests/conftest.py) with what the evaluate command's defaults would not give: responses of
# 80 tokens where its default is 64, prompts of 300 where it is 1024, cut at their end, a chat template's variable.
RUN_SETTINGS = ("data.max_response_length=80", "data.max_prompt_length=300", "data.truncation=right",
                "+data.apply_chat_template_kwargs.effort=low")


@pytest.fixture(scope="module")
def saved_run(workspace, tmp_path_factory):
    """The global_step_0 checkpoint of the tiny run trained with RUN_SETTINGS."""
    from rlhf_core.config import load_config
    from rlhf_core.main_ppo import build_trainer

    trainer = build_trainer(load_config(workspace.overrides(tmp_path_factory.mktemp("run") / "out", *RUN_SETTINGS)))
    return trainer.save_checkpoint()


def _evaluated_with(monkeypatch, argv):
    """The DataConfig the evaluate command hands the evaluation, stopped there (no model loads)."""
    from rlhf_core.cli.pipeline import evaluate
    from rlhf_core.pipeline import evaluate as module

    class Stop(Exception):
        pass

    seen = []

    def evaluated(model, val_files, data, **kwargs):
        seen.append(data)
        raise Stop

    monkeypatch.setattr(module, "evaluate_policy", evaluated)
    with pytest.raises(Stop):
        evaluate(argv)
    [data] = seen
    return (data.max_response_length, data.max_prompt_length, data.truncation, data.prompt_key,
            data.apply_chat_template_kwargs)


def test_the_evaluate_command_on_a_checkpoint_generates_as_its_run_trained_unless_told(saved_run, workspace,
                                                                                        monkeypatch, capsys):
    """A checkpoint of a run trained with data.max_response_length=80 was scored on responses cut at the command's
    own 64 tokens (and prompts at 1024, cut at their start, without the run's chat-template variables): a policy
    that answers at length read worse than the run's own validation said. Its run's values stand in for the options
    not given, and one line says so; an option given wins; a plain model folder keeps the defaults."""
    val, reward = workspace.root / "data" / "test.parquet", workspace.root / "reward.py"
    common = [str(val), "--custom-reward", str(reward)]
    run = (80, 300, "right", "prompt", {"effort": "low"})
    for model in (saved_run, saved_run.parent, saved_run / "actor" / "huggingface"):  # step, root, its export
        assert _evaluated_with(monkeypatch, [str(model), *common]) == run
        assert capsys.readouterr().err == (
            f"notice: as the run that saved {saved_run} trained (data.* of its config.yaml): --prompt-key prompt, "
            "--max-prompt-length 300, --max-response-length 80, --chat-template-kwargs '{\"effort\": \"low\"}', "
            "truncation=right; an option given here wins over its run's value\n")
    assert _evaluated_with(monkeypatch, [str(saved_run), *common, "--max-response-length", "64", "--prompt-key",
                                         "prompt", "--chat-template-kwargs", "{}"]) == \
        (64, 300, "right", "prompt", {})
    assert capsys.readouterr().err == (
        f"notice: as the run that saved {saved_run} trained (data.* of its config.yaml): --max-prompt-length 300, "
        "truncation=right; an option given here wins over its run's value\n")
    assert _evaluated_with(monkeypatch, [str(workspace.model), *common]) == (64, 1024, "left", "prompt", {})
    assert capsys.readouterr().err == ""


def test_the_evaluate_command_generates_a_checkpoints_responses_to_its_runs_length(saved_run, workspace,
                                                                                   monkeypatch, capsys):
    """End to end: the greedy responses of the checkpoint are generated up to the run's 80 tokens, not 64."""
    import rlhf_core.rollout as rollout
    from rlhf_core.cli.pipeline import evaluate

    asked = []
    make_engine = rollout.make_rollout_engine

    def recording(*args, **kwargs):
        engine = make_engine(*args, **kwargs)
        generate = engine.generate
        engine.generate = lambda batch, params: asked.append(params.max_new_tokens) or generate(batch, params)
        return engine

    monkeypatch.setattr(rollout, "make_rollout_engine", recording)
    assert evaluate([str(saved_run), str(workspace.root / "data" / "test.parquet"), "--max-problems", "2",
                     "--custom-reward", str(workspace.root / "reward.py")]) == 0
    assert asked == [80]
    assert capsys.readouterr().out.startswith("accuracy ")


def test_the_evaluate_command_cuts_prompts_as_by_default_where_the_run_refused_them_and_says_an_unread_config(
        workspace, tmp_path, monkeypatch, capsys):
    """A run with data.truncation=error cut no prompt: its checkpoint is evaluated cutting a long prompt's start, as
    any model is; a checkpoint whose config.yaml cannot be read is evaluated with the defaults, and that is said."""
    import shutil

    step = tmp_path / "global_step_3"
    shutil.copytree(workspace.model, step / "actor" / "huggingface")
    common = [str(workspace.root / "data" / "test.parquet"), "--custom-reward", str(workspace.root / "reward.py")]
    (step / "config.yaml").write_text("data:\n  truncation: error\n  max_response_length: 12\n  prompt_key: null\n")
    assert _evaluated_with(monkeypatch, [str(step), *common]) == (12, 1024, "left", "prompt", {})
    assert capsys.readouterr().err == (f"notice: as the run that saved {step} trained (data.* of its config.yaml): "
                                       "--max-response-length 12; an option given here wins over its run's value\n")
    (step / "config.yaml").write_text("data: [\n")
    assert _evaluated_with(monkeypatch, [str(step), *common]) == (64, 1024, "left", "prompt", {})
    err = capsys.readouterr().err
    assert err.startswith(f"notice: checkpoint {step}: cannot read config.yaml (") and err.endswith(
        "): evaluating with the options' own defaults where none is given\n") and len(err.splitlines()) == 1, err


def test_the_evaluate_command_says_a_missing_prompt_column_was_its_checkpoints_runs(workspace, tmp_path, capsys):
    """A checkpoint's run read its prompts from another column: where the file given lacks it, the error says that
    the column came from the run, not from an option the user gave, and how to name another."""
    import shutil

    from rlhf_core.cli.pipeline import evaluate

    step = tmp_path / "global_step_2"
    shutil.copytree(workspace.model, step / "actor" / "huggingface")
    (step / "config.yaml").write_text("data:\n  prompt_key: question\n")
    val = str(workspace.root / "data" / "test.parquet")
    assert evaluate([str(step), val, "--custom-reward", str(workspace.root / "reward.py")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: val_files: column(s) ['question'] missing; found ") and err.endswith(
        f" (the prompt column 'question' is the data.prompt_key of the run that saved {step}; --prompt-key COLUMN "
        "names another)\n") and len(err.splitlines()) == 1, err
    assert evaluate([str(step), val, "--custom-reward", str(workspace.root / "reward.py"), "--prompt-key",
                     "question"]) == 2  # given by the user: said as before, without the run
    err = capsys.readouterr().err
    assert "run that saved" not in err and err.startswith("error: val_files: column(s) ['question'] missing"), err


def test_the_training_curves_of_a_one_step_run_tick_that_step_alone():
    """A run of one step (or a panel of one point) was ticked 0.945, 0.96, ... 1.05: MaxNLocator keeps to whole
    numbers only where it finds two in view, and a view around step 1 holds one."""
    from rlhf_core.pipeline.evaluate import training_curves_figure

    history = [{"step": 1, "critic/score/mean": 0.4, "actor/ppo_kl": 0.0, "val-core/a/acc/mean@1": 0.5}]
    figure = training_curves_figure(history)
    figure.canvas.draw()
    for axes in figure.axes:
        low, high = axes.get_xlim()
        assert [float(tick) for tick in axes.get_xticks() if low <= tick <= high] == [1.0], axes.get_title()


def test_the_training_curves_put_each_step_at_one_place_in_every_panel():
    """Each panel had an axis of its own: the validation's from its first point (step 0, or a resumed run's step),
    the reward's and the KL's from the first step trained (here: 3 to 8 against 6 to 8), so one step stood at
    another place in each panel, and a validation run only at the last step got an axis of that step alone."""
    from rlhf_core.pipeline.evaluate import training_curves_figure

    history = [{"step": 3, "val-core/a/acc/mean@1": 0.25}]  # resumed at step 3: its validation there
    history += [{"step": step, "critic/score/mean": 0.1 * step, "actor/ppo_kl": 0.001} for step in (6, 7)]
    history += [{"step": 8, "critic/score/mean": 0.8, "actor/ppo_kl": 0.001, "val-core/a/acc/mean@1": 0.5}]
    figure = training_curves_figure(history)
    figure.canvas.draw()
    limits = {axes.get_title(): tuple(axes.get_xlim()) for axes in figure.axes}
    assert len(set(limits.values())) == 1, limits
    low, high = limits["reward"]
    assert low <= 3 < 6 and 8 <= high < 9  # the steps of every panel, 3 to 8, with the margin matplotlib adds
    for axes in figure.axes:  # the step labels stay under each panel
        shown = [label.get_text() for label in axes.get_xticklabels() if low <= label.get_position()[0] <= high]
        assert shown == ["3", "4", "5", "6", "7", "8"], shown


def test_the_training_curves_mark_a_step_whose_metric_was_not_finite():
    """A step whose KL or score was NaN (a skipped update, a reward that failed) left no trace: the history kept
    the finite numbers alone and the line ran straight from the step before to the step after, so the one step
    where the run went wrong looked like any other. It is now a gap in the line, an x at the panel's foot and a
    note in the legend."""
    from rlhf_core.main_ppo import RunResult
    from rlhf_core.pipeline.evaluate import training_curves_figure
    from rlhf_core.pipeline.training import whole_history
    from rlhf_core.training.trainer import StepResult

    # as the trainer hands them on: steps 1-5, the KL NaN at step 3 and inf at step 4, the score NaN at step 5
    kl = {1: 0.01, 2: 0.02, 3: float("nan"), 4: float("inf"), 5: 0.05}
    score = {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4, 5: float("nan")}
    result = RunResult(steps=5, wall_s=1.0, local_dir="/nonexistent", checkpoint=None,
                       history=[StepResult(step, {"critic/score/mean": score[step], "actor/ppo_kl": kl[step]})
                                for step in range(1, 6)])
    history = whole_history(result)
    json.dumps(history, allow_nan=False)  # the summary artifact stays plain JSON
    figure = training_curves_figure(history)
    panels = {axes.get_title(): axes for axes in figure.axes}

    (line, marks) = panels["KL"].lines
    assert list(line.get_xdata()) == [1, 2, 3, 4, 5]
    drawn = [float(value) for value in line.get_ydata()]
    assert drawn[:2] == [0.01, 0.02] and drawn[4] == 0.05 and all(math.isnan(value) for value in drawn[2:4])
    assert line.get_label() == "actor/ppo_kl (not finite at steps 3, 4)"
    assert list(marks.get_xdata()) == [3, 4] and marks.get_color() == line.get_color()
    assert [text.get_text() for text in panels["KL"].get_legend().get_texts()] == [line.get_label()]

    (line, marks) = panels["reward"].lines
    assert list(line.get_xdata()) == [1, 2, 3, 4, 5] and math.isnan(line.get_ydata()[4])
    assert line.get_label() == "critic/score/mean (not finite at step 5)" and list(marks.get_xdata()) == [5]
    figure.canvas.draw()
    assert panels["reward"].get_xlim()[1] > 5  # the last step, NaN, is still on the axis


def test_the_validation_panel_of_a_run_without_ground_truths_draws_its_validation_reward():
    """Validation prompts without a ground truth (a reward model's run) log val-core/<source>/reward/mean@1, their
    headline, and no accuracy: the panel said "not logged" of a run that validated at every test_freq steps."""
    from rlhf_core.pipeline.evaluate import curve_panels, training_curves_figure

    history = [{"step": 0, "val-core/chat/reward/mean@1": 0.2},
               {"step": 1, "critic/score/mean": 0.1},
               {"step": 2, "critic/score/mean": 0.3, "val-core/chat/reward/mean@1": 0.5}]
    assert curve_panels(history)[2] == ("validation reward", ["val-core/chat/reward/mean@1"])
    axes = training_curves_figure(history).axes[2]
    assert axes.get_title() == "validation reward" and not axes.texts
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in axes.lines] == [([0, 2], [0.2, 0.5])]
    # a run with accuracies draws them alone, its validation rewards being in val-aux/
    both = [{"step": 2, "val-core/a/acc/mean@1": 0.5, "val-aux/a/reward/mean@1": 0.4}]
    assert curve_panels(both)[2] == ("validation accuracy", ["val-core/a/acc/mean@1"])
