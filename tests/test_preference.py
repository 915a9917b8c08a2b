"""Preference pairs: the GSM8K model-solution converter, the split by question, the synthetic demo pairs."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest

from rlhf_core.cli.data import preference
from rlhf_core.data.preference import (
    GSM8K_MODELS,
    PREFERENCE_COLUMNS,
    PreferenceDataError,
    gsm8k_solution_pairs,
    read_preferences,
    split_by_group,
    synthetic_pairs,
)


def _row(question: str, solutions: list[tuple[str, bool]]) -> str:
    row = {"question": question, "ground_truth": "work\nA: 5"}
    for name, (text, ok) in zip(GSM8K_MODELS, solutions):
        row[name] = {"solution": text, "is_correct": ok}
    return json.dumps(row)


def test_pairs_are_correct_against_incorrect_with_identical_pairs_once(tmp_path):
    path = tmp_path / "solutions.jsonl"
    path.write_text("\n".join([
        # 2 correct solutions with the same text, 2 different incorrect ones: 2 distinct pairs (not 4)
        _row("Q1", [("right", True), ("right", True), ("wrong a", False), ("wrong b", False)]),
        # all correct: no pair
        _row("Q2", [("r1", True), ("r2", True), ("r3", True), ("r4", True)]),
        # 1 correct, 3 incorrect: 3 pairs
        _row("Q3", [("w1", False), ("ok", True), ("w2", False), ("w3", False)]),
    ]) + "\n")
    pairs = gsm8k_solution_pairs(path)
    got = [(p["question"], p["chosen"], p["rejected"]) for p in pairs]
    assert got == [("Q1", "right", "wrong a"), ("Q1", "right", "wrong b"),
                   ("Q3", "ok", "w1"), ("Q3", "ok", "w2"), ("Q3", "ok", "w3")]
    assert {p["group"] for p in pairs} == {"line-1", "line-3"}
    assert pairs[0]["answer"] == "5"


def test_a_question_on_two_lines_keeps_its_pairs_on_one_side_and_a_shared_pair_once(tmp_path):
    """Two releases joined give Q0 on lines 1 and 2, with other solutions the second time: grouped by the line each
    row is on, some seeds put Q0's pairs on both sides, which the trainer then refuses; grouped by the line where
    the question first appears, they stay together. The pair both lines hold is one pair."""
    path = tmp_path / "solutions.jsonl"
    path.write_text("\n".join([
        _row("Q0", [("right 0", True), ("wrong 0", False), ("bad 0", False), ("right2 0", True)]),  # 4 pairs
        # (right 0, wrong 0) again, and 3 new pairs
        _row("Q0", [("right 0", True), ("wrong 0", False), ("other 0", False), ("right3 0", True)]),
        _row("Q1", [("right 1", True), ("wrong 1", False), ("bad 1", False), ("right2 1", True)]),
        _row("Q2", [("right 2", True), ("wrong 2", False), ("bad 2", False), ("right2 2", True)]),
    ]) + "\n")
    pairs = gsm8k_solution_pairs(path)
    assert sorted((p["question"], p["chosen"], p["rejected"]) for p in pairs if p["question"] == "Q0") == [
        ("Q0", "right 0", "bad 0"), ("Q0", "right 0", "other 0"), ("Q0", "right 0", "wrong 0"),
        ("Q0", "right2 0", "bad 0"), ("Q0", "right2 0", "wrong 0"), ("Q0", "right3 0", "other 0"),
        ("Q0", "right3 0", "wrong 0")]
    assert len(pairs) == 7 + 4 + 4
    assert [p["group"] for p in pairs] == ["line-1"] * 7 + ["line-3"] * 4 + ["line-4"] * 4
    for seed in range(6):
        train, val = split_by_group(pairs, 0.5, seed=seed)
        assert not {p["question"] for p in train} & {p["question"] for p in val}, seed


def test_solutions_end_as_the_instruction_asks(tmp_path):
    path = tmp_path / "solutions.jsonl"
    path.write_text(_row("Q1", [("3 + 2 = <<3+2=5>>5\nA: 5", True), ("A: 6", False), ("no final line", False),
                                ("so A: is 7", False)]) + "\n")
    assert [(p["chosen"], p["rejected"]) for p in gsm8k_solution_pairs(path)] == [
        ("3 + 2 = <<3+2=5>>5\n#### 5", "#### 6"), ("3 + 2 = <<3+2=5>>5\n#### 5", "no final line"),
        ("3 + 2 = <<3+2=5>>5\n#### 5", "so A: is 7")]


def test_malformed_row_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(_row("Q1", [("a", True), ("b", False), ("c", False), ("d", False)]) + "\n{\"question\": 1}\n")
    with pytest.raises(PreferenceDataError, match="line 2"):
        gsm8k_solution_pairs(path)


@pytest.mark.parametrize("question, solutions, problem", [
    ("Q2", [("a", True), (None, False), ("c", False), ("d", False)], "6b_verification.solution is null"),
    (None, [("a", True), ("b", False), ("c", False), ("d", False)], "question is null"),
    (7, [("a", True), ("b", False), ("c", False), ("d", False)], "question is of type int"),
    ("Q2", [("a", True), ("b", False), ("c", False), (["d"], False)], "175b_verification.solution is of type list"),
])
def test_a_null_or_non_text_question_or_solution_names_the_line(tmp_path, question, solutions, problem):
    """Such a row stopped the command with an AttributeError or a TypeError that named no line."""
    path = tmp_path / "bad.jsonl"
    path.write_text(_row("Q1", [("a", True), ("b", False), ("c", False), ("d", False)]) + "\n"
                    + _row(question, solutions) + "\n")
    with pytest.raises(PreferenceDataError) as info:
        gsm8k_solution_pairs(path)
    assert str(info.value) == (
        f"{path}, line 2: not a model-solutions row (TypeError: {problem}, not text); each line needs 'question' and "
        "6b_finetuning, 6b_verification, 175b_finetuning, 175b_verification with 'solution' and 'is_correct'")


def test_real_gsm8k_pairs_count(gsm8k_dir):
    """2,429 (correct, incorrect) combinations over 731 questions; 3 repeat an earlier pair's text."""
    source = gsm8k_dir / "example_model_solutions.jsonl"
    combinations, distinct, questions = 0, 0, 0
    for line in source.read_text().splitlines():
        row = json.loads(line)
        right = [row[m]["solution"] for m in GSM8K_MODELS if row[m]["is_correct"]]
        wrong = [row[m]["solution"] for m in GSM8K_MODELS if not row[m]["is_correct"]]
        combinations += len(right) * len(wrong)
        distinct += len({(r, w) for r in right for w in wrong})
        questions += bool(right and wrong)
    assert (combinations, questions) == (2429, 731)
    pairs = gsm8k_solution_pairs(source)
    assert len(pairs) == distinct == 2426
    assert len({p["group"] for p in pairs}) == 731
    # every real solution closes with "A: <answer>"; as pairs they close with "#### <answer>", which the GSM8K
    # rule reads: each chosen solution earns full marks, no rejected one does
    from rlhf_core.rewards.gsm8k import compute_score

    assert all(compute_score(p["chosen"], p["answer"]) == 1.0 for p in pairs)
    assert not any(compute_score(p["rejected"], p["answer"]) == 1.0 for p in pairs)


def test_real_gsm8k_pairs_are_each_questions_labelled_right_against_its_labelled_wrong(gsm8k_dir):
    """Every pair, rebuilt from the release's own is_correct labels: a solution labelled correct against one labelled
    incorrect of the same question, each with its closing "A: x" line written "#### x", and nothing else."""
    expected, first = set(), {}
    for number, line in enumerate((gsm8k_dir / "example_model_solutions.jsonl").read_text().splitlines(), start=1):
        row = json.loads(line)
        texts = {True: set(), False: set()}
        for name in GSM8K_MODELS:
            lines = row[name]["solution"].split("\n")
            if lines[-1].startswith("A:"):
                lines[-1] = "#### " + lines[-1][2:].strip()
            texts[bool(row[name]["is_correct"])].add("\n".join(lines))
        group = f"line-{first.setdefault(' '.join(row['question'].split()).casefold(), number)}"  # its first line
        expected |= {(group, row["question"], right, wrong)
                     for right in texts[True] for wrong in texts[False] if right != wrong}
    pairs = gsm8k_solution_pairs(gsm8k_dir / "example_model_solutions.jsonl")
    got = [(p["group"], p["question"], p["chosen"], p["rejected"]) for p in pairs]
    assert len(got) == len(set(got)) and set(got) == expected


def test_split_keeps_each_question_on_one_side():
    pairs = [{"group": f"q{g}", "i": i} for g in range(50) for i in range(g % 4 + 1)]
    train, val = split_by_group(pairs, 0.2, seed=3)
    assert len(train) + len(val) == len(pairs)
    assert not {p["group"] for p in train} & {p["group"] for p in val}
    assert len({p["group"] for p in val}) == 10  # 20% of 50 questions
    assert split_by_group(pairs, 0.2, seed=3) == (train, val)  # seeded
    with pytest.raises(PreferenceDataError, match="val-fraction"):
        split_by_group(pairs, 1.0)


@pytest.mark.parametrize("n_groups, val_fraction, n_val", [
    (2, 0.75, 1),  # round(1.5) = 2 would leave training no question
    (3, 0.9, 2),  # round(2.7) = 3
    (2, 0.1, 1),  # round(0.2) = 0: validation still gets one
    (10, 0.5, 5),
])
def test_split_leaves_each_side_at_least_one_question(n_groups, val_fraction, n_val):
    pairs = [{"group": f"q{g}", "i": i} for g in range(n_groups) for i in range(2)]
    train, val = split_by_group(pairs, val_fraction)
    assert len({p["group"] for p in val}) == n_val
    assert len({p["group"] for p in train}) == n_groups - n_val
    assert len(train) + len(val) == len(pairs)


def test_split_of_a_single_question_is_refused():
    with pytest.raises(PreferenceDataError, match=r"on 1 question\(s\): .*at least 2.*--val-fraction \(0.2\)"):
        split_by_group([{"group": "q0"}, {"group": "q0"}], 0.2)


def test_cli_split_of_two_questions_at_a_large_fraction_keeps_one_for_training(tmp_path, capsys):
    out = tmp_path / "pairs"
    assert preference(["--gsm8k-solutions", str(_solutions(tmp_path, n=2)), "--output", str(out),
                       "--val-fraction", "0.75"]) == 0
    train, val = pd.read_parquet(out / "train.parquet"), pd.read_parquet(out / "val.parquet")
    assert (len(train), len(val)) == (4, 4)  # one question each, 4 pairs a question
    assert "train: 4 pairs over 1 questions" in capsys.readouterr().out


def test_cli_holds_out_a_fifth_of_the_questions_by_default(tmp_path, capsys):
    out = tmp_path / "pairs"
    assert preference(["--gsm8k-solutions", str(_solutions(tmp_path, n=10)), "--output", str(out)]) == 0
    val = pd.read_parquet(out / "val.parquet")
    # 0.2 of 10 questions is 2, with their 4 pairs each
    assert len(set(val["extra_info"].map(lambda e: e["question"]))) == 2 and len(val) == 8


def test_cli_refuses_a_single_question_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "pairs"
    assert preference(["--gsm8k-solutions", str(_solutions(tmp_path, n=1)), "--output", str(out),
                       "--val-fraction", "0.5"]) == 1
    err = capsys.readouterr().err
    assert "error: the pairs are on 1 question(s): a split by question needs at least 2" in err
    assert "--val-fraction (0.5)" in err
    assert not out.exists()


def test_synthetic_pairs_right_answer_against_the_slip():
    train, val = synthetic_pairs(30, 10, seed=0)
    assert len(train) == 30 and len(val) == 10  # one-step problems: the slip never equals the result
    assert not {p["question"] for p in train} & {p["question"] for p in val}
    for pair in train + val:
        first_number = re.search(r"\d+", pair["question"]).group(0)
        assert pair["chosen"].rsplit("####", 1)[1].strip() == pair["answer"]
        assert pair["rejected"].rsplit("####", 1)[1].strip() == first_number != pair["answer"]
        assert pair["chosen"].rsplit("####", 1)[0] == pair["rejected"].rsplit("####", 1)[0]  # same working


def test_synthetic_pairs_leave_out_excluded_questions():
    train, val = synthetic_pairs(30, 10, seed=0)
    excluded = {p["question"] for p in train[:5] + val[:3]}
    train2, val2 = synthetic_pairs(30, 10, seed=0, exclude=excluded)
    assert len(train2) == 30 and len(val2) == 10
    assert not excluded & {p["question"] for p in train2 + val2}
    assert not {p["question"] for p in train2} & {p["question"] for p in val2}


def test_synthetic_exclude_keeps_out_a_question_written_in_another_case(tmp_path, capsys):
    """--exclude compares questions with the case folded and whitespace collapsed for the synthetic source too: a
    prompt file asking the plain draw's questions in capitals and with doubled spaces keeps their pairs out (the
    count said they were drawn again while the written pairs still held them, which the pipeline then refused)."""
    from rlhf_core.data.preference import check_apart_from_prompts

    train, val = synthetic_pairs(30, 10, seed=0)
    asked = [p["question"] for p in train[:5] + val[:3]]
    prompts = _prompt_file(tmp_path / "test.parquet", [q.upper().replace(" ", "  ") for q in asked])
    out = tmp_path / "pairs"
    assert preference(["--synthetic", "--n-train", "30", "--n-val", "10", "--output", str(out),
                       "--exclude", str(prompts)]) == 0
    assert f"excluded: 8 pair(s) on questions of {prompts}, drawn again on other questions\n" in capsys.readouterr().out
    written = pd.concat([pd.read_parquet(out / "train.parquet"), pd.read_parquet(out / "val.parquet")])
    questions = {e["question"] for e in written["extra_info"]}
    assert len(written) == 40 and not set(asked) & questions
    assert check_apart_from_prompts([out / "train.parquet", out / "val.parquet"], [prompts]) == 40


def test_cli_writes_both_splits_in_the_schema(tmp_path, capsys):
    source = tmp_path / "solutions.jsonl"
    source.write_text("\n".join(
        _row(f"Q{i}", [(f"right {i}", True), (f"wrong {i}", False), (f"bad {i}", False), (f"right2 {i}", True)])
        for i in range(20)) + "\n")
    out = tmp_path / "pairs"
    assert preference(["--gsm8k-solutions", str(source), "--output", str(out), "--val-fraction", "0.25"]) == 0
    # the questions are GSM8K's test split: the warning says so, and what not to do with them
    err = capsys.readouterr().err
    assert "warning: These pairs are built from GSM8K *test* questions" in err
    assert "do not evaluate on GSM8K test a policy" in err and "leak the test set" in err
    train, val = pd.read_parquet(out / "train.parquet"), pd.read_parquet(out / "val.parquet")
    assert tuple(train.columns) == tuple(val.columns) == PREFERENCE_COLUMNS
    assert (len(train), len(val)) == (15 * 4, 5 * 4)
    assert not set(train["extra_info"].map(lambda e: e["question"])) & set(val["extra_info"].map(lambda e: e["question"]))
    assert list(train["prompt"].iloc[0][0].keys()) == ["role", "content"]
    assert set(train["data_source"]) == {"openai/gsm8k"}
    # an existing output is kept
    assert preference(["--gsm8k-solutions", str(source), "--output", str(out)]) == 2


def test_help_says_the_questions_are_gsm8k_test(capsys):
    with pytest.raises(SystemExit):
        preference(["--help"])
    assert "GSM8K *test* questions" in capsys.readouterr().out


def test_read_preferences_names_missing_columns(tmp_path):
    path = tmp_path / "prompts.parquet"
    pd.DataFrame({"prompt": [[{"role": "user", "content": "x"}]], "data_source": ["s"],
                  "extra_info": [{"split": "train"}]}).to_parquet(path)
    with pytest.raises(PreferenceDataError, match=r"lacks the column\(s\) chosen, rejected"):
        read_preferences(path)


@pytest.mark.parametrize("column, texts, rows", [
    ("chosen", ["#### 5", "   ", "#### 5"], "1 (blank)"),
    ("rejected", ["\n\t ", "#### 6", ""], "0 (blank), 2 (empty)"),
    ("chosen", ["#### 5", None, "#### 5"], "1 (null)"),
    ("rejected", [[{"role": "assistant", "content": "#### 6"}]] * 3,  # TRL's conversational pairs
     "0 (chat messages), 1 (chat messages), 2 (chat messages)"),
    ("chosen", [5, 6, 7], "0 (int), 1 (int), 2 (int)"),
])
def test_read_preferences_refuses_empty_blank_and_missing_texts(tmp_path, column, texts, rows):
    """A response of only whitespace is refused as the pipeline's validation refuses it ('holds a non-blank
    character'), not only an empty one; each row named says what it holds instead of a text."""
    path = tmp_path / "pairs.parquet"
    frame = pd.DataFrame([_pair([{"role": "user", "content": f"What is {i} + 3?"}]) for i in range(3)])
    frame[column] = texts
    frame.to_parquet(path)
    with pytest.raises(PreferenceDataError) as info:
        read_preferences(path)
    convert = (f" (TRL's conversational pairs convert with python -m rlhf_core.data.preference --trl {path} --output "
               "DIR)" if "chat messages" in rows else "")
    assert str(info.value) == (f"{path}: column {column} is not a response's text in row(s) {rows}; {column} holds "
                               "the assistant's reply as one non-blank string, the conversation before it being the "
                               f"prompt's messages{convert}")


def test_the_pair_counts_read_as_a_line_in_the_pipelines_log():
    """validate_preferences logged its counts as a dict's repr ({'train_pairs': 2000, ...})."""
    from rlhf_core.data.preference import counts_line

    assert counts_line({"train_pairs": 2000, "val_pairs": 400, "train_prompts": 1990, "val_prompts": 400}) == (
        "pairs: 2,000 for training over 1,990 prompts, 400 held out over 400 prompts")
    assert counts_line({"train_pairs": 3, "val_pairs": 0, "train_prompts": 3, "val_prompts": 0}) == (
        "pairs: 3 for training over 3 prompts, none held out")


def test_check_preference_files_refuses_shared_prompts_and_identical_texts(tmp_path):
    from rlhf_core.data.preference import check_preference_files, to_frame

    def write(name, pairs):
        path = tmp_path / name
        to_frame(pairs, "x", "s").to_parquet(path)
        return path

    train = write("train.parquet", [{"question": "Q1", "chosen": "a", "rejected": "b", "group": "1"},
                                    {"question": "Q2", "chosen": "c", "rejected": "d", "group": "2"}])
    val = write("val.parquet", [{"question": "Q3", "chosen": "e", "rejected": "f", "group": "3"}])
    assert check_preference_files([train], [val]) == {"train_pairs": 2, "val_pairs": 1, "train_prompts": 2,
                                                      "val_prompts": 1}
    leaky = write("leaky.parquet", [{"question": "Q2", "chosen": "x", "rejected": "y", "group": "2"}])
    with pytest.raises(PreferenceDataError, match="1 prompt"):
        check_preference_files([train], [leaky])
    same = write("same.parquet", [{"question": "Q4", "chosen": "z", "rejected": "z", "group": "4"}])
    with pytest.raises(PreferenceDataError, match=r"same.parquet: chosen and rejected are the same text in row\(s\) 0"):
        check_preference_files([same], [])
    empty = write("empty.parquet", [{"question": "Q5", "chosen": "u", "rejected": "v", "group": "5"}])
    pd.read_parquet(empty).iloc[:0].to_parquet(empty)
    with pytest.raises(PreferenceDataError, match=r"validation file\(s\) .*empty.parquet hold no pair: .*"
                                                  r"reward_model.train.val_files=null"):
        check_preference_files([train], [empty])
    assert check_preference_files([train], [])["val_pairs"] == 0  # no validation files: nothing to refuse


def _pair(prompt) -> dict:
    return {"prompt": prompt, "chosen": "#### 5", "rejected": "#### 6", "data_source": "s",
            "extra_info": {"split": "train"}}


GOOD_PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.mark.parametrize("prompts, named", [
    ([GOOD_PROMPT, GOOD_PROMPT, None], "1 prompt(s) are not chat messages (prompt is null in row(s) 2)"),
    ([GOOD_PROMPT, [], [{"role": "user", "content": None}], []],
     "3 prompt(s) are not chat messages (prompt is an empty list of messages in row(s) 1, 3; "
     "prompt message 0 has a null 'content' in row(s) 2)"),
    (["What is 2 + 3?", "What is 4 + 1?"],
     "2 prompt(s) are not chat messages (prompt is a plain string, not a list of {role, content} messages in "
     "row(s) 0, 1)"),
    ([["What is 2 + 3?"]],
     "1 prompt(s) are not chat messages (prompt message 0 is a str, not a {role, content} mapping in row(s) 0)"),
    ([[{"content": "What is 2 + 3?"}]], "1 prompt(s) are not chat messages (prompt message 0 has no 'role' in row(s) 0)"),
    ([b"What is 2 + 3?\xff"], "1 prompt(s) are not chat messages (prompt is binary (bytes), not a list of "
                              "{role, content} messages in row(s) 0)"),
])
def test_read_preferences_names_the_rows_whose_prompt_is_not_chat_messages(tmp_path, prompts, named):
    path = tmp_path / "pairs.parquet"
    pd.DataFrame([_pair(p) for p in prompts]).to_parquet(path)
    with pytest.raises(PreferenceDataError) as info:
        read_preferences(path)
    assert str(info.value).startswith(f"{path}: {named}; a prompt is a non-empty list of ")


def test_check_preference_frames_names_a_bad_prompt_of_frames_in_memory():
    from pathlib import Path

    from rlhf_core.data.preference import check_preference_frames

    train = pd.DataFrame([_pair(GOOD_PROMPT), _pair(None)])
    with pytest.raises(PreferenceDataError, match=r"^train.parquet: 1 prompt\(s\) are not chat messages "
                                                  r"\(prompt is null in row\(s\) 1\)"):
        check_preference_frames([(Path("train.parquet"), train)], [])
    more = pd.DataFrame([_pair(None) for _ in range(7)])
    with pytest.raises(PreferenceDataError, match=r"7 prompt\(s\) are not chat messages \(prompt is null in "
                                                  r"row\(s\) 0, 1, 2, 3, 4 \.\.\.\)"):
        check_preference_frames([(Path("train.parquet"), more)], [])


def test_check_preference_frames_starts_a_files_error_with_the_key_that_named_it():
    from pathlib import Path

    from rlhf_core.data.preference import check_preference_frames

    good = pd.DataFrame([_pair(GOOD_PROMPT)])
    same = pd.DataFrame([_pair([{"role": "user", "content": "Q2"}]) | {"rejected": "#### 5"}])
    keys = {"train": "reward_model.train.train_files", "val": "reward_model.train.val_files"}
    with pytest.raises(PreferenceDataError) as info:
        check_preference_frames([(Path("t.parquet"), good)], [(Path("v.parquet"), same)], keys)
    assert str(info.value) == ("reward_model.train.val_files: v.parquet: chosen and rejected are the same text in "
                               "row(s) 0; such a pair teaches nothing, drop it")
    with pytest.raises(PreferenceDataError, match=r"^reward_model.train.train_files: t.parquet: 1 prompt\(s\)"):
        check_preference_frames([(Path("t.parquet"), pd.DataFrame([_pair(None)]))], [], keys)


def test_canonical_prompt_reads_arrays_and_leaves_out_nulls_at_every_level():
    import numpy as np

    from rlhf_core.data.preference import canonical_prompt

    # as pandas reads a parquet message: a list as a NumPy array, every field any row has, None where a row has none
    message = {"role": "assistant", "content": "", "name": None,
               "tool_calls": np.array([{"name": "calc", "arguments": "{}", "id": None}], dtype=object)}
    assert canonical_prompt(np.array([message], dtype=object)) == (
        '[{"content": "", "role": "assistant", "tool_calls": [{"arguments": "{}", "name": "calc"}]}]')


def _tool_prompt(question, call) -> list[dict]:
    return [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "user", "content": question}]


def test_check_preference_files_compares_prompts_with_tool_calls(tmp_path):
    """A list inside a message (tool_calls) stopped the check with a TypeError (JSON cannot write the NumPy array
    pandas reads it as); a tool call's id on one row of a file gives the others id None, which hid a prompt that
    train and val share."""
    from rlhf_core.data.preference import check_preference_files

    call, with_id = {"name": "calc", "arguments": "{}"}, {"name": "calc", "arguments": "{}", "id": "c7"}
    train, val, leaky = tmp_path / "train.parquet", tmp_path / "val.parquet", tmp_path / "leaky.parquet"
    pd.DataFrame([_pair(_tool_prompt("Q1", call)), _pair(_tool_prompt("Q2", with_id))]).to_parquet(train)
    pd.DataFrame([_pair(_tool_prompt("Q3", call))]).to_parquet(val)
    assert check_preference_files([train], [val]) == {"train_pairs": 2, "val_pairs": 1, "train_prompts": 2,
                                                      "val_prompts": 1}
    pd.DataFrame([_pair(_tool_prompt("Q1", call))]).to_parquet(leaky)  # train's row 0, written without an id field
    with pytest.raises(PreferenceDataError, match=r"^1 prompt\(s\) have pairs in both the training and the "
                                                  r"validation files \(e\.g\. 'Q1'\)"):
        check_preference_files([train], [leaky])


# ----------------------------------------------------------------------------- options of the other source


def _solutions(tmp_path, n=20):
    """n questions Q0..Q(n-1), each with 2 correct and 2 incorrect solutions: 4 pairs a question."""
    source = tmp_path / "solutions.jsonl"
    source.write_text("\n".join(
        _row(f"Q{i}", [(f"right {i}", True), (f"wrong {i}", False), (f"bad {i}", False), (f"right2 {i}", True)])
        for i in range(n)) + "\n")
    return source


@pytest.mark.parametrize("source, options, message", [
    (["--synthetic"], ["--val-fraction", "0.3"], "--val-fraction only applies to --gsm8k-solutions and --trl; "
                                                  "--synthetic does not use it"),
    (["--gsm8k-solutions", "S"], ["--data-source", "x"], "--data-source only applies to --trl; --gsm8k-solutions "
                                                         "does not use it"),
    (["--trl", "S"], ["--n-train", "10"], "--n-train only applies to --synthetic; --trl does not use it"),
    (["--gsm8k-solutions", "S"], ["--n-train", "10"], "--n-train only applies to --synthetic; --gsm8k-solutions "
                                                      "does not use it"),
    (["--gsm8k-solutions", "S"], ["--n-val", "5", "--n-train", "10"],
     "--n-train and --n-val only apply to --synthetic; --gsm8k-solutions does not use them"),
])
def test_an_option_of_the_other_source_is_refused(tmp_path, capsys, source, options, message):
    solutions = _solutions(tmp_path, n=3)
    source = [str(solutions) if s == "S" else s for s in source]
    out = tmp_path / "pairs"
    with pytest.raises(SystemExit) as info:
        preference([*source, "--output", str(out), *options])
    assert info.value.code == 2
    assert f"error: {message}\n" in capsys.readouterr().err
    assert not out.exists()


# ----------------------------------------------------------------------------- pairs kept apart from prompt sets


def _prompt_file(path, questions, split="test"):
    """A prompt parquet in the schema the data commands write (the question plus the instruction)."""
    from rlhf_core.data.schema import PROMPT_COLUMNS, make_record

    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [make_record(q, f"#### {i}", str(i), split, i, "s") for i, q in enumerate(questions)]
    pd.DataFrame(rows, columns=list(PROMPT_COLUMNS)).to_parquet(path)
    return path


def test_exclude_drops_the_gsm8k_pairs_on_questions_of_the_prompt_data(tmp_path, capsys):
    source = _solutions(tmp_path)
    # a folder: its train.parquet as the data commands write it (Q3 and a question without pairs) and a test.parquet
    # of another source (a system turn, no instruction, no extra_info, stray spaces) holding Q7
    folder = tmp_path / "prompts"
    _prompt_file(folder / "train.parquet", ["Q3", "not among the pairs"], split="train")
    pd.DataFrame({"prompt": [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Q7  "}]]}
                 ).to_parquet(folder / "test.parquet")
    out = tmp_path / "pairs"
    assert preference(["--gsm8k-solutions", str(source), "--output", str(out), "--val-fraction", "0.5",
                       "--exclude", str(folder)]) == 0
    assert f"excluded: 8 pair(s) over 2 question(s) of {folder}\n" in capsys.readouterr().out
    train, val = pd.read_parquet(out / "train.parquet"), pd.read_parquet(out / "val.parquet")
    questions = [e["question"] for e in pd.concat([train, val])["extra_info"]]
    assert sorted(set(questions)) == sorted(f"Q{i}" for i in range(20) if i not in (3, 7))
    assert (len(train), len(val)) == (9 * 4, 9 * 4)  # half of the 18 questions left, 4 pairs each


def test_exclude_that_leaves_no_pair_is_refused_and_writes_nothing(tmp_path, capsys):
    source = _solutions(tmp_path, n=3)
    prompts = _prompt_file(tmp_path / "test.parquet", ["Q0", "Q1", "Q2"])
    out = tmp_path / "pairs"
    assert preference(["--gsm8k-solutions", str(source), "--output", str(out), "--exclude", str(prompts)]) == 1
    captured = capsys.readouterr()
    assert "excluded: 12 pair(s) over 3 question(s)" in captured.out
    assert f"error: every pair of {source} is on a question of --exclude ({prompts}): no pair is left" in captured.err
    assert not out.exists()


def test_exclude_names_a_missing_path_and_a_file_that_is_not_prompt_data(tmp_path, capsys):
    source = _solutions(tmp_path, n=3)
    assert preference(["--gsm8k-solutions", str(source), "--output", str(tmp_path / "a"),
                       "--exclude", str(tmp_path / "nowhere.parquet")]) == 1
    assert f"error: prompt data {tmp_path / 'nowhere.parquet'} does not exist" in capsys.readouterr().err
    other = tmp_path / "other.parquet"
    pd.DataFrame({"text": ["Q0"]}).to_parquet(other)
    assert preference(["--gsm8k-solutions", str(source), "--output", str(tmp_path / "b"), "--exclude", str(other)]) == 1
    assert f"error: {other} is not prompt data: it has no 'prompt' column (its columns: text)" in capsys.readouterr().err


def test_synthetic_exclude_draws_other_questions_so_the_counts_hold(tmp_path, capsys):
    train, val = synthetic_pairs(30, 10, seed=0)
    excluded = [p["question"] for p in train[:5] + val[:3]]  # 8 distinct questions the plain draw has pairs on
    prompts = _prompt_file(tmp_path / "test.parquet", excluded)
    out = tmp_path / "pairs"
    assert preference(["--synthetic", "--n-train", "30", "--n-val", "10", "--output", str(out),
                       "--exclude", str(prompts)]) == 0
    assert f"excluded: 8 pair(s) on questions of {prompts}, drawn again on other questions\n" in capsys.readouterr().out
    train2, val2 = pd.read_parquet(out / "train.parquet"), pd.read_parquet(out / "val.parquet")
    assert (len(train2), len(val2)) == (30, 10)
    questions = [e["question"] for e in pd.concat([train2, val2])["extra_info"]]
    assert len(set(questions)) == 40 and not set(excluded) & set(questions)


def test_the_demo_pairs_stay_apart_from_the_demo_evaluation_prompts(tmp_path, capsys):
    """The demo's prompt data (make demo-assets) and its pairs at --seed 1 (make demo-rm's seed, 0, draws none on
    them): without --exclude, 3 of the 1,024 evaluation questions have pairs; with it none has, and the pairs are
    still 2,000 + 400."""
    from rlhf_core.data.synthetic import build_dataset

    data = build_dataset(tmp_path / "synthetic", 8192, 1024, seed=1, max_ops=1, max_operand=12)
    evaluation = set(pd.read_parquet(data["test"])["extra_info"].map(lambda e: e["question"]))
    for name, extra in (("plain", []), ("apart", ["--exclude", str(data["test"])])):
        assert preference(["--synthetic", "--seed", "1", "--output", str(tmp_path / name), *extra]) == 0
    assert f"excluded: 3 pair(s) on questions of {data['test']}" in capsys.readouterr().out
    for name, shared in (("plain", 3), ("apart", 0)):
        frames = [pd.read_parquet(tmp_path / name / f"{split}.parquet") for split in ("train", "val")]
        assert [len(f) for f in frames] == [2000, 400]
        questions = set(pd.concat(frames)["extra_info"].map(lambda e: e["question"]))
        assert len(questions & evaluation) == shared


def test_synthetic_exclude_that_leaves_too_few_questions_is_refused(tmp_path, capsys, monkeypatch):
    """The draws stop after a bounded run of excluded or repeated questions: with a run of 1 allowed, excluding the
    first question of the validation stream (the only val pair of the plain draw) leaves none to draw."""
    import rlhf_core.data.synthetic as synthetic

    _, val = synthetic_pairs(1, 1, seed=0)
    prompts = _prompt_file(tmp_path / "test.parquet", [val[0]["question"]])
    monkeypatch.setattr(synthetic, "_MAX_DUPLICATE_RUN", 1)
    out = tmp_path / "pairs"
    assert preference(["--synthetic", "--n-train", "1", "--n-val", "1", "--output", str(out),
                       "--exclude", str(prompts)]) == 1
    err = capsys.readouterr().err
    assert (f"error: the demo task has too few questions outside the prompt data of --exclude ({prompts}) for "
            "--n-train 1 and --n-val 1: ask for fewer (only 0 distinct problems found before 1 duplicates") in err
    assert not out.exists()


def test_check_apart_from_prompts_names_the_pairs_on_evaluation_questions(tmp_path):
    from rlhf_core.data.preference import check_apart_from_prompts, to_frame

    pairs = tmp_path / "pairs.parquet"
    to_frame([{"question": q, "chosen": "#### 1", "rejected": "#### 2", "group": q} for q in ("Q1", "Q2", "Q3")],
             "train", "s").to_parquet(pairs)
    apart = _prompt_file(tmp_path / "apart.parquet", ["Q4", "Q5"])
    assert check_apart_from_prompts([pairs], [apart]) == 3
    evaluation = _prompt_file(tmp_path / "test.parquet", ["Q5", "Q3", "Q1"])
    with pytest.raises(PreferenceDataError) as info:
        check_apart_from_prompts([pairs], [evaluation])
    assert str(info.value) == (
        f"2 preference pair(s) are on questions of the evaluation prompts ({evaluation}), e.g. {pairs}: 'Q1'; a "
        "reward model fitted on them leaks those questions into the PPO reward. Rebuild the pairs with "
        f"python -m rlhf_core.data.preference ... --exclude {evaluation} --overwrite")


def test_pairs_are_kept_apart_from_a_question_written_in_another_case(tmp_path, capsys):
    """A prompt set that asks a pair's question in other letters' case (and spacing) still holds that question, as
    the data validation compares questions: --exclude drops its pairs and the check refuses them, showing the
    pair's question as written."""
    from rlhf_core.data.preference import check_apart_from_prompts, to_frame

    source = _solutions(tmp_path)
    folder = tmp_path / "prompts"
    _prompt_file(folder / "test.parquet", ["q3", "  Q7 "])
    out = tmp_path / "pairs"
    assert preference(["--gsm8k-solutions", str(source), "--output", str(out), "--val-fraction", "0.5",
                       "--exclude", str(folder)]) == 0
    assert f"excluded: 8 pair(s) over 2 question(s) of {folder}\n" in capsys.readouterr().out
    pairs = tmp_path / "pairs.parquet"
    to_frame([{"question": "Q3", "chosen": "#### 1", "rejected": "#### 2", "group": "Q3"}], "train", "s"
             ).to_parquet(pairs)
    with pytest.raises(PreferenceDataError, match=r"1 preference pair\(s\) are on questions of the evaluation "
                                                  r"prompts \(.*\), e\.g\. .*pairs\.parquet: 'Q3'"):
        check_apart_from_prompts([pairs], [folder / "test.parquet"])


def test_exclude_takes_prompts_stored_as_one_string_as_the_trainer_does(tmp_path, capsys):
    """verl's and the trainer's prompt data may hold a prompt as one string (the user turn): its questions are
    compared like a message list's, not refused."""
    source = _solutions(tmp_path, n=4)  # two questions left: one for each side of the split
    prompts = tmp_path / "test.parquet"
    pd.DataFrame({"prompt": ["Q1", " Q2 " + "Let's think step by step and output the final answer after \"####\"."],
                  "reward_model": [{"style": "rule", "ground_truth": "1"}] * 2}).to_parquet(prompts)
    out = tmp_path / "pairs"
    assert preference(["--gsm8k-solutions", str(source), "--output", str(out), "--exclude", str(prompts)]) == 0
    assert f"excluded: 8 pair(s) over 2 question(s) of {prompts}\n" in capsys.readouterr().out
    questions = {e["question"] for name in ("train", "val") for e in pd.read_parquet(out / f"{name}.parquet")["extra_info"]}
    assert questions == {"Q0", "Q3"}
    # the JSON text of a message list is still refused: the trainer refuses it too
    pd.DataFrame({"prompt": ['[{"role": "user", "content": "Q1"}]']}).to_parquet(prompts)
    assert preference(["--gsm8k-solutions", str(source), "--output", str(tmp_path / "b"), "--exclude", str(prompts)]) == 1
    assert "1 prompt(s) are not chat messages" in capsys.readouterr().err


# ----------------------------------------------------------------------------- TRL's preference files


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "Answer with #### and the number."}


def _trl_rows(form: str, n: int = 4) -> list[dict]:
    """n pairs in one of TRL's forms, question i answered i + 1 (chosen) against i (rejected)."""
    rows = []
    for i in range(n):
        question, right, wrong = f"What is {i} + 1?", f"#### {i + 1}", f"#### {i}"
        if form == "standard explicit":
            rows.append({"prompt": question, "chosen": right, "rejected": wrong})
        elif form == "conversational explicit":
            rows.append({"prompt": [SYSTEM, _user(question)], "chosen": [_assistant(right)],
                         "rejected": [_assistant(wrong)]})
        elif form == "conversational implicit":
            rows.append({"chosen": [SYSTEM, _user(question), _assistant(right)],
                         "rejected": [SYSTEM, _user(question), _assistant(wrong)]})
        else:  # standard implicit: whole texts, prompt included
            rows.append({"chosen": f"Human: {question} Assistant: {right}",
                         "rejected": f"Human: {question} Assistant: {wrong}"})
    return rows


@pytest.mark.parametrize("form, suffix, prompt", [
    ("standard explicit", ".parquet", lambda q: [_user(q)]),
    ("conversational explicit", ".jsonl", lambda q: [SYSTEM, _user(q)]),
    ("conversational implicit", ".parquet", lambda q: [SYSTEM, _user(q)]),
    ("conversational implicit", ".json", lambda q: [SYSTEM, _user(q)]),
    # one line holding a JSON array (json.dump, to_json(orient='records')): read as JSON lines, one row of 10 columns
    ("standard explicit", ".json array", lambda q: [_user(q)]),
    ("conversational explicit", ".json array", lambda q: [SYSTEM, _user(q)]),
])
def test_trl_preference_files_convert_to_pairs_that_train_and_validate(tmp_path, capsys, form, suffix, prompt):
    """Each of TRL's forms with its prompt found becomes this schema's rows: the prompt as chat messages (a text
    prompt as the user's turn), chosen and rejected as the reply's text; the files written pass the reward-model
    trainer's reading and the pipeline's preference suite."""
    from rlhf_core.data.preference import check_preference_files
    from rlhf_core.data.validation import validate_preference_files

    source = tmp_path / f"hh_train{suffix.split()[0]}"
    frame = pd.DataFrame(_trl_rows(form, n=10))
    if suffix == ".parquet":
        frame.to_parquet(source)
    elif suffix == ".json array":
        source.write_text(json.dumps(_trl_rows(form, n=10)))
    else:
        frame.to_json(source, orient="records", lines=True)
    out = tmp_path / "pairs"
    assert preference(["--trl", str(source), "--output", str(out), "--val-fraction", "0.2"]) == 0
    printed = capsys.readouterr().out
    assert f"read: 10 pairs from {source} ({form.replace(' ', ', ')} prompt)" in printed
    assert "train: 8 pairs over 8 prompts" in printed and "val: 2 pairs over 2 prompts" in printed
    rows = pd.concat([read_preferences(out / "train.parquet"), read_preferences(out / "val.parquet")])
    assert tuple(rows.columns) == PREFERENCE_COLUMNS and set(rows["data_source"]) == {"hh_train"}
    got = sorted((json.dumps([dict(m) for m in p]), c, r) for p, c, r in zip(rows["prompt"], rows["chosen"],
                                                                          rows["rejected"]))
    assert got == sorted((json.dumps(prompt(f"What is {i} + 1?")), f"#### {i + 1}", f"#### {i}") for i in range(10))
    assert set(rows["extra_info"].map(lambda e: e["question"])) == {f"What is {i} + 1?" for i in range(10)}
    assert check_preference_files([out / "train.parquet"], [out / "val.parquet"])["train_pairs"] == 8
    assert validate_preference_files([out / "train.parquet"], [out / "val.parquet"]).success


def test_trl_split_follows_the_seed(tmp_path, capsys):
    source = tmp_path / "hh_train.parquet"
    pd.DataFrame(_trl_rows("standard explicit", n=20)).to_parquet(source)
    held_out = {}
    for seed in ("1", "2", "1 again"):
        out = tmp_path / seed.replace(" ", "_")
        assert preference(["--trl", str(source), "--output", str(out), "--seed", seed.split()[0]]) == 0
        held_out[seed] = sorted(pd.read_parquet(out / "val.parquet")["chosen"])
    assert len(held_out["1"]) == 4  # 0.2 of 20 prompts, one pair each
    assert held_out["1"] != held_out["2"]
    assert held_out["1"] == held_out["1 again"]


def test_trl_pairs_leave_out_rows_whose_chosen_and_rejected_are_the_same(tmp_path):
    from rlhf_core.data.preference import trl_pairs

    rows = _trl_rows("conversational implicit", n=3)
    rows[1]["rejected"] = rows[1]["chosen"]  # the same conversation twice
    rows.append({"chosen": [_user("Hi"), _assistant("Hello")], "rejected": [_user("Hi"), _assistant("Hello")]})
    path = tmp_path / "pairs.parquet"
    pd.DataFrame(rows).to_parquet(path)
    pairs, identical, repeated, form = trl_pairs(path)
    assert (identical, repeated, form) == (2, 0, "conversational, implicit prompt")
    assert [(p["question"], p["chosen"], p["rejected"]) for p in pairs] == [("What is 0 + 1?", "#### 1", "#### 0"),
                                                                           ("What is 2 + 1?", "#### 3", "#### 2")]


def test_trl_rows_repeating_a_pair_are_left_out_and_counted(tmp_path, capsys):
    """Public preference sets repeat some rows; kept, the pipeline's no_duplicate_pairs check refused the files the
    command wrote. A row with the same prompt and another reply is a pair of its own."""
    from rlhf_core.data.preference import trl_pairs
    from rlhf_core.data.validation import validate_preference_files

    rows = _trl_rows("standard explicit", n=10)
    rows += [dict(rows[3]), dict(rows[3]), rows[5] | {"rejected": "#### 7"}, dict(rows[8])]
    path = tmp_path / "hh.parquet"
    pd.DataFrame(rows).to_parquet(path)
    pairs, identical, repeated, form = trl_pairs(path)
    assert (len(pairs), identical, repeated, form) == (11, 0, 3, "standard, explicit prompt")
    assert [(p["question"], p["rejected"]) for p in pairs if p["question"] == "What is 5 + 1?"] == [
        ("What is 5 + 1?", "#### 5"), ("What is 5 + 1?", "#### 7")]
    out = tmp_path / "pairs"
    assert preference(["--trl", str(path), "--output", str(out)]) == 0
    assert (f"read: 11 pairs from {path} (standard, explicit prompt, 3 left out: the same pair as an earlier row)"
            in capsys.readouterr().out)
    assert validate_preference_files([out / "train.parquet"], [out / "val.parquet"]).success


JSON_TEXT = ("the JSON text of a message list; it would train as one turn holding the JSON: store the list itself "
             "(e.g. frame[{0!r}] = frame[{0!r}].map(json.loads) before writing the file)")


@pytest.mark.parametrize("rows, message", [
    # (a CSV round trip): taken as text, the prompt was one user turn holding the JSON, which the prompt data refuses
    ([{"prompt": json.dumps([SYSTEM, _user("What is 2 + 2?")]), "chosen": "#### 4", "rejected": "#### 5"}] * 2,
     f"2 of 2 row(s) cannot be read as preference pairs: prompt is {JSON_TEXT.format('prompt')} in row(s) 0, 1"),
    ([{"chosen": json.dumps([_user("Q"), _assistant("A")]), "rejected": json.dumps([_user("Q"), _assistant("B")])}],
     f"1 of 1 row(s) cannot be read as preference pairs: chosen is {JSON_TEXT.format('chosen')} in row(s) 0"),
    ([{"prompt": [_user("Q")], "chosen": [_assistant("A")], "rejected": json.dumps([_assistant("B")])}],
     f"1 of 1 row(s) cannot be read as preference pairs: rejected is {JSON_TEXT.format('rejected')} in row(s) 0"),
    (_trl_rows("standard implicit", n=2),
     "2 of 2 row(s) cannot be read as preference pairs: chosen and rejected are not chat messages and there is no "
     "prompt column: an implicit prompt is read from whole conversations only (text holds no turns to tell the "
     "prompt from the reply); give a prompt column in row(s) 0, 1"),
    ([{"prompt": [_user("Q")], "chosen": [_user("Q"), _assistant("A")], "rejected": [_assistant("B")]}],
     "1 of 1 row(s) cannot be read as preference pairs: chosen holds 2 message(s) (user, assistant) after the "
     "prompt: a reply is one assistant message in row(s) 0"),
    ([{"chosen": [_user("Q1"), _assistant("A")], "rejected": [_user("Q2"), _assistant("B")]},
      {"chosen": [_user("Q"), _assistant("A"), _user("more?"), _assistant("C")],
       "rejected": [_user("Q"), _assistant("B")]}],
     "2 of 2 row(s) cannot be read as preference pairs: chosen and rejected begin with different messages: an "
     "implicit prompt is the messages both begin with in row(s) 0; chosen and rejected differ before their last "
     "message (4 and 2 messages, 1 shared): an implicit prompt is all messages but the reply in row(s) 1"),
    ([{"prompt": "Q", "chosen": "  ", "rejected": "B"}, {"prompt": "", "chosen": "A", "rejected": "B"}],
     "2 of 2 row(s) cannot be read as preference pairs: chosen is blank in row(s) 0; prompt is empty in row(s) 1"),
    ([{"prompt": "Q", "completion": "A", "label": True}],
     "holds unpaired preferences (prompt, completion, label: TRL's form for KTO); a reward model trains on pairs of "
     "a chosen and a rejected reply to one prompt"),
])
def test_trl_rows_that_cannot_be_paired_are_named_with_their_reason(tmp_path, capsys, rows, message):
    path = tmp_path / "trl.parquet"
    pd.DataFrame(rows).to_parquet(path)
    out = tmp_path / "pairs"
    assert preference(["--trl", str(path), "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert message in err and str(path) in err
    assert not out.exists()


def test_a_trl_file_given_to_the_trainer_names_the_conversion(tmp_path):
    explicit, conversational = tmp_path / "explicit.parquet", tmp_path / "conversational.parquet"
    pd.DataFrame(_trl_rows("standard explicit", n=2)).to_parquet(explicit)
    with pytest.raises(PreferenceDataError) as info:
        read_preferences(explicit)
    assert str(info.value).endswith(f"lacks the column(s) data_source, extra_info (a preference row has prompt, "
                                    f"chosen, rejected, data_source, extra_info); TRL's preference files convert with "
                                    f"python -m rlhf_core.data.preference --trl {explicit} --output DIR")
    frame = pd.DataFrame(_trl_rows("conversational explicit", n=2))
    frame["data_source"], frame["extra_info"] = "s", [{"split": "train"}] * 2
    frame.to_parquet(conversational)
    with pytest.raises(PreferenceDataError, match=re.escape(
            f"(TRL's conversational pairs convert with python -m rlhf_core.data.preference --trl {conversational} "
            "--output DIR)")):
        read_preferences(conversational)


def test_trl_pairs_on_questions_of_the_exclude_prompts_are_dropped(tmp_path, capsys):
    source = tmp_path / "trl.parquet"
    pd.DataFrame(_trl_rows("conversational implicit", n=6)).to_parquet(source)
    prompts = _prompt_file(tmp_path / "eval" / "test.parquet", ["What is 3 + 1?", "What is 5 + 1?", "Unrelated?"])
    out = tmp_path / "pairs"
    assert preference(["--trl", str(source), "--output", str(out), "--exclude", str(prompts)]) == 0
    assert f"excluded: 2 pair(s) over 2 prompt(s) of {prompts}" in capsys.readouterr().out
    rows = pd.concat([read_preferences(out / "train.parquet"), read_preferences(out / "val.parquet")])
    assert sorted(rows["chosen"]) == ["#### 1", "#### 2", "#### 3", "#### 5"]


def test_trl_pairs_whose_user_turn_ends_with_the_instruction_are_dropped_by_their_question(tmp_path, capsys):
    """TRL pairs built from verl's GSM8K prompts ask each question with the instruction after it: --exclude compared
    that whole turn with the prompt data's questions, dropped nothing, and the check then refused the pairs it
    wrote."""
    from rlhf_core.data.preference import check_apart_from_prompts

    instruction = ' Let\'s think step by step and output the final answer after "####".'
    rows = [{"prompt": [_user(f"What is {i} + 1?{instruction}")], "chosen": [_assistant(f"#### {i + 1}")],
             "rejected": [_assistant(f"#### {i}")]} for i in range(6)]
    source = tmp_path / "trl.parquet"
    pd.DataFrame(rows).to_parquet(source)
    prompts = _prompt_file(tmp_path / "eval" / "test.parquet", ["What is 3 + 1?", "What is 5 + 1?"])
    out = tmp_path / "pairs"
    assert preference(["--trl", str(source), "--output", str(out), "--exclude", str(prompts)]) == 0
    assert f"excluded: 2 pair(s) over 2 prompt(s) of {prompts}" in capsys.readouterr().out
    rows = pd.concat([read_preferences(out / "train.parquet"), read_preferences(out / "val.parquet")])
    assert sorted(rows["chosen"]) == ["#### 1", "#### 2", "#### 3", "#### 5"]
    assert check_apart_from_prompts([out / "train.parquet", out / "val.parquet"], [prompts]) == 4
