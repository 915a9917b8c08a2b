"""Tests for the Great Expectations checks on verl prompt datasets."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from rlhf_core.cli.data import validate
from rlhf_core.data.schema import extract_final_answer, make_record
from rlhf_core.data.validation import (
    DataReadError,
    ValidationReport,
    asked,
    fingerprint,
    flatten,
    load_tokenizer,
    question_key,
    read_parquet,
    splits_fingerprint,
    validate_dataset,
    validate_frames,
)

REPO = Path(__file__).resolve().parents[1]
SOURCE = "openai/gsm8k"
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def records(n: int = 5, split: str = "train", offset: int = 0) -> list[dict]:
    rows = []
    for i in range(offset, offset + n):
        question = f"Tom has {i} apples and buys {i + 3} more. How many apples does he have?"
        solution = f"He has {i} + {i + 3} = {2 * i + 3} apples.\n#### {2 * i + 3}"
        rows.append(make_record(question, solution, str(2 * i + 3), split, i, SOURCE))
    return rows


def write(path: Path, rows: list[dict]) -> Path:
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


def failed(report: ValidationReport) -> list[tuple[str, str | None, str]]:
    return [(o.name, o.column, o.dataset) for o in report.failures]


@pytest.fixture(scope="module")
def char_tokenizer():
    """A character-level tokenizer without a chat template (built offline)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1}
    for code in list(range(32, 127)) + [10]:
        vocab.setdefault(chr(code), len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")


@pytest.fixture(scope="module")
def chat_tokenizer_dir(char_tokenizer, tmp_path_factory):
    """The same tokenizer with a chat template, saved to a folder."""
    tokenizer = copy.deepcopy(char_tokenizer)
    tokenizer.chat_template = TEMPLATE
    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def valid_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("valid")
    train = records(6)
    # Every accepted ground-truth form: thousands commas, minus sign, decimals, padding.
    for row, truth in zip(train, ["1,234", "-7", "3.25", " 42 ", "0"]):
        row["reward_model"]["ground_truth"] = truth
    return write(folder / "train.parquet", train), write(folder / "val.parquet", records(3, "test", 100))


# ---------------------------------------------------------------------------------------------
# Valid data


def test_valid_data_passes(valid_files, chat_tokenizer_dir):
    train, val = valid_files
    report = validate_dataset(train, val, tokenizer=chat_tokenizer_dir, max_prompt_length=512)
    assert report.success, report.summary()
    assert report.failures == []
    names = {o.name for o in report.results}
    assert {
        "has_rows",
        "column_exists",
        "not_null",
        "data_source_known",
        "prompt_is_non_empty_message_list",
        "prompt_has_user_turn",
        "prompt_user_content_non_empty",
        "ground_truth_numeric",
        "no_train_val_leakage",
        "prompt_length_within_limit",
    } <= names
    assert report.find("no_train_val_leakage")[0].dataset == "val"
    assert [d.rows for d in report.datasets] == [6, 3]
    assert report.fingerprint == splits_fingerprint(train, val)
    payload = json.loads(json.dumps(report.to_dict()))
    assert payload["success"] is True
    assert payload["statistics"]["unsuccessful_expectations"] == 0
    assert "PASSED" in report.summary()
    length = report.find("prompt_length_within_limit", dataset="train")[0]
    assert length.statistics["share_over"] == 0.0


def test_a_tokenizer_with_code_of_its_own_loads_only_when_trusted(valid_files, chat_tokenizer_dir, tmp_path):
    """A tokenizer folder whose class is code in it (tokenizer_config.json's auto_map) loads as the trainer loads it,
    with actor_rollout_ref.model.trust_remote_code, which validate_data passes on; without it, it is refused."""
    import json
    import shutil

    folder = tmp_path / "custom_tokenizer"
    shutil.copytree(chat_tokenizer_dir, folder)
    (folder / "char_tok.py").write_text("from transformers import PreTrainedTokenizerFast\n\n\n"
                                        "class CharTokenizerFast(PreTrainedTokenizerFast):\n    pass\n")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.update(tokenizer_class="CharTokenizerFast", auto_map={"AutoTokenizer": [None, "char_tok.CharTokenizerFast"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    train, val = valid_files
    with pytest.raises(DataReadError, match=r"cannot load tokenizer \(.*trust_remote_code"):
        validate_dataset(train, val, tokenizer=str(folder), max_prompt_length=512)
    assert type(load_tokenizer(str(folder), trust_remote_code=True)).__name__ == "CharTokenizerFast"
    report = validate_dataset(train, val, tokenizer=str(folder), max_prompt_length=512, trust_remote_code=True)
    assert report.success, report.summary()
    # the command: refused without --trust-remote-code, as the library is
    from rlhf_core.cli.data import validate as validate_command

    command = [str(path) for path in (train if isinstance(train, list) else [train])]
    command += ["--val", *[str(path) for path in (val if isinstance(val, list) else [val])],
                "--tokenizer", str(folder), "--max-prompt-length", "512"]
    assert validate_command(command) == 2
    assert validate_command([*command, "--trust-remote-code"]) == 0


# ---------------------------------------------------------------------------------------------
# One bad row at a time


def _null_ground_truth(row):
    row["reward_model"]["ground_truth"] = None


def _text_ground_truth(row):
    row["reward_model"]["ground_truth"] = "12 apples"


def _zero_fraction_ground_truth(row):
    row["reward_model"]["ground_truth"] = "13.0"  # a float column written as text: "#### 13" would score 0


def _empty_prompt(row):
    row["prompt"] = []


def _empty_content(row):
    row["prompt"] = [{"role": "user", "content": ""}]


def _blank_content(row):
    row["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  \n "}]


def _no_user_turn(row):
    row["prompt"] = [{"role": "system", "content": "You are a helpful assistant."}]


def _unknown_source(row):
    row["data_source"] = "nobody/knows"


def _null_source(row):
    row["data_source"] = None


# Each case breaks one row of a shared table: (mutation, expectation, helper column, reported value).
BAD_ROWS = [
    (_null_ground_truth, "not_null", "ground_truth", None),
    (_text_ground_truth, "ground_truth_numeric", "ground_truth", "12 apples"),
    (_zero_fraction_ground_truth, "ground_truth_numeric", "ground_truth", "13.0"),
    (_empty_prompt, "prompt_is_non_empty_message_list", "prompt_problem", "prompt is an empty list of messages"),
    (_empty_content, "prompt_user_content_non_empty", "prompt_user_content", ""),
    (_blank_content, "prompt_user_content_non_empty", "prompt_user_content", "  \n "),
    (_no_user_turn, "prompt_has_user_turn", "prompt_has_user_turn", False),
    (_unknown_source, "data_source_known", "data_source", "nobody/knows"),
    (_null_source, "not_null", "data_source", None),
]


def plant(rows: list[dict], cases: list[tuple]) -> list[dict]:
    """``rows`` with bad case ``i`` (its mutation first) in row ``i + 1``: rows 0 and the last stay good."""
    for position, (mutate, *_rest) in enumerate(cases):
        mutate(rows[position + 1])
    return rows


@pytest.fixture(scope="module")
def bad_report(tmp_path_factory):
    """One validation run over a table whose row ``i + 1`` carries bad case ``i``."""
    rows = plant(records(len(BAD_ROWS) + 2), BAD_ROWS)
    return validate_dataset(write(tmp_path_factory.mktemp("bad") / "train.parquet", rows))


def test_bad_rows_fail_exactly_their_expectations(bad_report):
    expected: dict[tuple[str, str], list[int]] = {}
    for position, (_mutate, name, column, _value) in enumerate(BAD_ROWS):
        expected.setdefault((name, column), []).append(position + 1)
    assert not bad_report.success
    got = {(o.name, o.column): [index for index, _ in o.examples] for o in bad_report.failures}
    assert got == expected, bad_report.summary()
    for outcome in bad_report.failures:
        assert outcome.dataset == "train"
        assert outcome.statistics["unexpected_count"] == len(expected[(outcome.name, outcome.column)])


@pytest.mark.parametrize(
    ("position", "case"), list(enumerate(BAD_ROWS)), ids=[case[0].__name__.strip("_") for case in BAD_ROWS]
)
def test_bad_row_is_named_with_its_value(bad_report, position, case):
    _mutate, name, column, value = case
    [outcome] = bad_report.find(name, column)
    assert not outcome.success
    assert (position + 1, value) in outcome.examples
    summary = bad_report.summary()
    assert f"FAILED {name} [train.{column}]" in summary
    assert f"row {position + 1}: {value!r}" in summary


def test_missing_column_is_reported_and_dependent_checks_skipped():
    frame = pd.DataFrame(records(4)).drop(columns=["reward_model"])
    report = validate_frames(frame)  # prompt data by the caller's word, so only reward_model is missing
    assert failed(report) == [("column_exists", "reward_model", "train")]
    assert not any(o.column == "ground_truth" for o in report.results)
    assert any("ground_truth_numeric" in item and "reward_model" in item for item in report.skipped)
    assert report.find("column_exists", "prompt")[0].success
    assert "column 'reward_model' is missing" in report.summary()


def test_prompt_lengths_are_measured_without_extra_info(char_tokenizer):
    frame = pd.DataFrame(records(3)).drop(columns=["extra_info"])
    report = validate_frames(frame, tokenizer=char_tokenizer, max_prompt_length=512)
    assert report.success, report.summary()  # extra_info is optional, as the trainer (and verl) take it
    assert report.find("prompt_length_within_limit")[0].success  # measured: it needs only the prompt
    # the trainer numbers rows without extra_info by their row in the file: ids 0, 1, 2, all distinct
    assert report.find("problem_id_unique")[0].success
    assert not any("problem_id_unique" in item for item in report.skipped)


def test_a_tool_call_list_read_from_parquet_is_measured_as_the_trainer_renders_it(tmp_path):
    # pandas reads the list inside the message as a NumPy array; rendered as one, its calls would lose their names
    from rlhf_core.models.toy import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                         "{% for c in m.tool_calls or [] %}<call {{ c.name }}>{% endfor %}|{% endfor %}Assistant: ")
    row = records(1)[0]
    row["prompt"] = [{"role": "user", "content": "add", "tool_calls": None},
                     {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": "{}"}]},
                     {"role": "user", "content": "so?", "tool_calls": None}]
    frame = pd.read_parquet(write(tmp_path / "t.parquet", [row]))
    rendered = len("user: add|assistant: <call add>|user: so?|Assistant: ")  # 52 characters, a token each
    fits = validate_frames(frame, tokenizer=tok, max_prompt_length=rendered)
    assert fits.find("prompt_length_within_limit")[0].success, fits.summary()
    over = validate_frames(frame, tokenizer=tok, max_prompt_length=rendered - 1)
    assert not over.find("prompt_length_within_limit")[0].success


def test_empty_table_fails_has_rows():
    frame = pd.DataFrame(records(2)).iloc[0:0]
    report = validate_frames(frame)
    assert failed(report) == [("has_rows", None, "train")]


def test_train_val_leakage_names_the_leaking_val_row(tmp_path):
    train = records(5)
    val = records(4, "test", 50)
    val[2]["prompt"] = copy.deepcopy(train[1]["prompt"])
    report = validate_dataset(write(tmp_path / "train.parquet", train), write(tmp_path / "val.parquet", val))
    assert failed(report) == [("no_train_val_leakage", "prompt_asked", "val")]
    outcome = report.failures[0]
    assert outcome.examples == [(2, train[1]["prompt"][0]["content"])]
    assert outcome.statistics["unexpected_count"] == 1


@pytest.mark.parametrize("edit", [
    lambda text: text + " ",                      # a trailing space
    lambda text: text.replace(" ", "  ", 1),      # a doubled space
    lambda text: text + "\n",                     # a newline at the end
    lambda text: text.replace(" ", "\n\t", 2),    # a line break and a tab for spaces
    str.upper,                                    # the case changed
    lambda text: "  " + text.lower(),             # leading spaces and lower case
], ids=["trailing_space", "double_space", "newline_end", "newline_tab", "upper", "leading_lower"])
def test_a_leaked_question_written_with_other_spacing_or_case_is_caught(tmp_path, edit):
    """Compared character for character, each of these edits of a training question passed as a new one."""
    train = records(5)
    val = records(4, "test", 50)
    question = edit(train[1]["prompt"][0]["content"])
    val[2]["prompt"] = [{"role": "user", "content": question}]
    report = validate_dataset(write(tmp_path / "train.parquet", train), write(tmp_path / "val.parquet", val))
    assert failed(report) == [("no_train_val_leakage", "prompt_asked", "val")]
    assert report.failures[0].examples == [(2, question)]  # val's row as written
    assert report.failures[0].statistics["unexpected_count"] == 1


def test_a_question_differing_by_more_than_spacing_or_case_is_no_leak(tmp_path):
    train = records(5)
    val = records(2, "test", 50)
    val[1]["prompt"] = [{"role": "user", "content": train[1]["prompt"][0]["content"].replace("?", "!")}]
    report = validate_dataset(write(tmp_path / "train.parquet", train), write(tmp_path / "val.parquet", val))
    assert report.success, report.summary()


def test_a_question_asked_twice_in_the_validation_split_fails_with_both_rows(tmp_path):
    """Under distinct ids the copies passed, and evaluation counted each as a problem: the promotion's paired test
    saw the same evidence twice."""
    val = records(4, "test", 50)  # indices 50..53: every id differs
    asked = val[1]["prompt"][0]["content"]  # "Tom has 51 apples and buys 54 more. How many ... "####"."
    val[3]["prompt"] = [{"role": "user", "content": " " + asked.replace("Tom", "TOM").replace(" more. ", " more.\n")}]
    val[3]["reward_model"] = dict(val[1]["reward_model"])
    report = validate_dataset(write(tmp_path / "train.parquet", records(5)), write(tmp_path / "val.parquet", val))
    assert failed(report) == [("question_unique", "prompt_question", "val")]
    outcome = report.failures[0]
    question = ("tom has 51 apples and buys 54 more. how many apples does he have? let's think step by step and "
                'output the final answer after "####".')
    assert outcome.examples == [(1, question), (3, question)]
    assert outcome.statistics["unexpected_count"] == 2
    summary = report.summary()
    assert "FAILED question_unique [val.prompt_question]" in summary
    assert "    rows 1, 3 ask 'tom has 51 apples" in summary


def ask(rows: list[dict], asked_at: dict[str, list[int]]) -> list[dict]:
    """``rows`` with each question put to the rows listed for it, under one ground truth."""
    for question, at in asked_at.items():
        for row in at:
            rows[row]["prompt"] = [{"role": "user", "content": question}]
            rows[row]["reward_model"] = dict(rows[at[0]]["reward_model"])
    return rows


def test_every_copy_of_a_question_is_named_by_question(tmp_path):
    """Only the first three failing rows were named: of four copies of one question and two of another, the
    summary and the step's failed_examples showed rows 1, 2, 3 and said nothing of 6 and 7."""
    val = ask(records(8, "test", 50), {"What is 2 plus 2?": [1, 3, 4, 6], "What is 3 plus 3?": [2, 7]})
    report = validate_dataset(write(tmp_path / "train.parquet", records(5)), write(tmp_path / "val.parquet", val))
    assert failed(report) == [("question_unique", "prompt_question", "val")]
    assert report.failures[0].statistics["unexpected_count"] == 6
    named = ["rows 1, 3, 4, 6 ask 'what is 2 plus 2?'", "rows 2, 7 ask 'what is 3 plus 3?'"]
    assert report.failed_examples()["question_unique [val.prompt_question]"]["rows"] == named
    assert report.summary().splitlines()[-3:-1] == [f"    {line}" for line in named]


def test_the_copies_named_stop_at_max_copies_and_the_rest_are_counted(tmp_path):
    # one question in 12 rows, then 11 more questions in 2 rows each: 12 questions, 34 rows
    asked_at = {"Question A?": list(range(12)), **{f"Question {n}?": [10 + 2 * n, 11 + 2 * n] for n in range(1, 12)}}
    val = ask(records(34, "test", 50), asked_at)
    report = validate_dataset(write(tmp_path / "train.parquet", records(5)), write(tmp_path / "val.parquet", val))
    assert report.failures[0].statistics["unexpected_count"] == 34
    rows = report.failed_examples()["question_unique [val.prompt_question]"]["rows"]
    assert rows[0] == "rows 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 and 2 more ask 'question a?'"
    assert rows[1] == "rows 12, 13 ask 'question 1?'" and rows[9] == "rows 28, 29 ask 'question 9?'"
    assert rows[10:] == ["and 2 more questions asked more than once, in 4 more rows"]


def test_copies_in_several_files_are_named_by_file_and_row(tmp_path):
    first = ask(records(3, "test", 50), {"What is 2 plus 2?": [1]})
    second = ask(records(2, "test", 60), {"WHAT is 2 plus 2?": [0]})
    second[0]["reward_model"] = dict(first[1]["reward_model"])
    paths = [write(tmp_path / "a.parquet", first), write(tmp_path / "b.parquet", second)]
    report = validate_dataset(write(tmp_path / "train.parquet", records(5)), paths)
    assert report.failed_examples()["question_unique [val.prompt_question]"]["rows"] == [
        f"{paths[0]} row 1, {paths[1]} row 0 ask 'what is 2 plus 2?'"]


FOLLOW_UP = "Now give only the final answer."


def multi_turn(question: str, thought: str = "Let me think.") -> list[dict]:
    """A problem, an assistant's turn, and the follow-up every such conversation ends with."""
    return [{"role": "user", "content": question}, {"role": "assistant", "content": thought},
            {"role": "user", "content": FOLLOW_UP}]


def test_distinct_problems_ending_in_one_follow_up_are_neither_copies_nor_leaks(tmp_path):
    """Keyed on the last user turn, every one of these rows asked "now give only the final answer.": each
    validation row failed question_unique and no_train_val_leakage, and the message said to drop them."""
    train, val = records(5), records(3, "test", 50)
    for row in train + val:
        row["prompt"] = multi_turn(row["prompt"][0]["content"])
    report = validate_dataset(write(tmp_path / "train.parquet", train), write(tmp_path / "val.parquet", val))
    assert report.success, report.summary()
    assert report.find("question_unique", dataset="val")[0].success
    assert report.find("no_train_val_leakage", dataset="val")[0].success


def test_a_multi_turn_question_asked_again_is_caught_whatever_the_assistant_said(tmp_path):
    train, val = records(3), records(4, "test", 50)
    train[1]["prompt"] = multi_turn("What is 2 plus 2?")
    val[0]["prompt"] = multi_turn("what is  2 plus 2?\n", thought="Four, I think.")  # train's row 1
    val[1]["prompt"] = multi_turn("What is 3 plus 3?")
    val[2]["prompt"] = multi_turn("What is 4 plus 4?")
    val[3]["prompt"] = multi_turn("WHAT is 3 plus 3?", thought="Six.")  # val's row 1
    report = validate_dataset(write(tmp_path / "train.parquet", train), write(tmp_path / "val.parquet", val))
    assert sorted(failed(report)) == [("no_train_val_leakage", "prompt_asked", "val"),
                                      ("question_unique", "prompt_question", "val")]
    leak = report.find("no_train_val_leakage")[0]  # val's user turns as written, the assistant's left out
    assert leak.examples == [(0, '[["user", "what is  2 plus 2?\\n"], ["user", "Now give only the final answer."]]')]
    copies = report.find("question_unique")[0]
    question = '[["user", "what is 3 plus 3?"], ["user", "now give only the final answer."]]'
    assert copies.examples == [(1, question), (3, question)]
    assert copies.statistics["unexpected_count"] == 2


@pytest.mark.parametrize("role, first, second, same", [
    ("system", "Passage: Ann has 3 cats.", "Passage: Ben has 5 dogs.", False),  # the system turn holds the problem
    ("developer", "Passage: Ann has 3 cats.", "Passage: Ben has 5 dogs.", False),
    ("system", "Passage: Ann has 3 cats.", "passage:  ANN has 3 cats.\n", True),  # spacing and case aside
    ("system", " \n", None, True),  # a blank system turn asks nothing: as a prompt without one
], ids=["system_differs", "developer_differs", "system_respaced", "blank_system"])
def test_the_system_turn_is_part_of_the_question(tmp_path, role, first, second, same):
    val = records(3, "test", 50)
    for row, context in ((1, first), (2, second)):
        instructions = [{"role": role, "content": context}] if context is not None else []
        val[row]["prompt"] = instructions + [{"role": "user", "content": "How many animals are there?"}]
    val[2]["reward_model"] = dict(val[1]["reward_model"])
    report = validate_dataset(write(tmp_path / "train.parquet", records(5)), write(tmp_path / "val.parquet", val))
    outcome = report.find("question_unique", dataset="val")[0]
    assert outcome.success is not same, report.summary()
    assert [row for row, _ in outcome.examples] == ([1, 2] if same else [])


def test_prompts_given_as_one_string_are_compared_as_their_user_turn(tmp_path):
    train, val = records(3), records(4, "test", 50)
    train[1]["prompt"] = [{"role": "user", "content": "What is 2 plus 2?"}]
    val = pd.DataFrame(val).assign(prompt=["what is 2 PLUS 2? ", "What is 3 plus 3?", "Ann has 4 cats.",
                                           "what is 3 plus 3?"])
    val.to_parquet(tmp_path / "val.parquet", index=False)
    report = validate_dataset(write(tmp_path / "train.parquet", train), tmp_path / "val.parquet")
    assert sorted(failed(report)) == [("no_train_val_leakage", "prompt_asked", "val"),
                                      ("question_unique", "prompt_question", "val")]
    assert report.find("no_train_val_leakage")[0].examples == [(0, "what is 2 PLUS 2? ")]
    assert report.find("question_unique")[0].examples == [(1, "what is 3 plus 3?"), (3, "what is 3 plus 3?")]


def test_asked_tells_a_conversation_from_any_one_text():
    system_and_user = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]
    assert asked(system_and_user) == '[["system", "a"], ["user", "b"]]'
    assert asked([{"role": "user", "content": '[["system", "a"], ["user", "b"]]'}]) != asked(system_and_user)
    assert asked([{"role": "user", "content": "  What  IS 2?"}], question_key) == "what is 2?"
    assert asked([{"role": "system", "content": "a"}, {"role": "assistant", "content": "b"}]) is None


def test_a_question_asked_twice_in_the_training_split_passes(tmp_path):
    """Training samples prompts and counts nothing per question: a repeat there is no finding."""
    train = records(5)
    train[4]["prompt"] = copy.deepcopy(train[0]["prompt"])
    train[4]["reward_model"] = dict(train[0]["reward_model"])
    report = validate_dataset(write(tmp_path / "train.parquet", train),
                              write(tmp_path / "val.parquet", records(2, "test", 50)))
    assert report.success, report.summary()
    assert report.find("question_unique", dataset="train") == []
    assert report.find("question_unique", dataset="val")[0].success


def test_problem_ids_repeated_across_files_fail_with_both_rows(tmp_path):
    # two validation files numbered from 0 each: evaluation would pair problems by id and mix them up
    first, second = records(3, "test", 0), records(2, "test", 0)
    for row in second:
        row["prompt"][0]["content"] += " Count carefully."  # other problems, same ids
    report = validate_dataset([write(tmp_path / "a.parquet", first), write(tmp_path / "b.parquet", second)])
    assert failed(report) == [("problem_id_unique", "problem_id", "train")]
    outcome = report.failures[0]
    assert outcome.statistics["unexpected_count"] == 4  # rows 0, 1 of the first file and 3, 4 (its second)
    assert outcome.examples == [(0, f"{SOURCE}/0"), (1, f"{SOURCE}/1"), (3, f"{SOURCE}/0")]  # the first three


def test_with_a_custom_reward_any_source_and_any_answer_pass(tmp_path):
    rows = records(3)
    rows[1]["data_source"], rows[1]["reward_model"]["ground_truth"] = "my/capitals", "Paris"
    path = write(tmp_path / "custom.parquet", rows)
    assert sorted(failed(validate_dataset(path))) == [("data_source_known", "data_source", "train"),
                                                      ("ground_truth_numeric", "ground_truth", "train")]
    report = validate_dataset(path, custom_reward=True)
    assert report.success, report.summary()
    assert "train: data_source_known, ground_truth_numeric (a custom reward function scores every source)" \
        in report.skipped
    assert report.find("not_null", "ground_truth")[0].success  # the trainer still needs a ground truth
    from rlhf_core.cli.data import validate

    assert (validate([str(path)]), validate([str(path), "--custom-reward"])) == (1, 0)


def test_data_replaced_after_validation_is_caught_before_it_is_used(tmp_path):
    from rlhf_core.data.validation import DataChangedError, check_unchanged

    train, val = write(tmp_path / "train.parquet", records(4)), write(tmp_path / "val.parquet", records(2, "test", 50))
    validated = validate_dataset(train, val).fingerprint
    check_unchanged(train, [val], validated, "train_ppo")  # the same bytes: nothing to say
    check_unchanged(train, val, None, "train_ppo")  # nothing validated (a skipped run): nothing to hold to
    with pytest.raises(DataChangedError):  # the same files with their roles swapped are other data
        check_unchanged(val, train, validated, "train_ppo")
    write(train, records(5))  # a nightly job drops new data in place mid-run
    with pytest.raises(DataChangedError, match=rf"train_ppo: the data files changed since they were validated "
                                               rf"\(fingerprint {validated[:12]} then, [0-9a-f]{{12}} now: "):
        check_unchanged(train, val, validated, "train_ppo")


def test_data_replaced_while_it_is_validated_is_caught_by_the_validation(tmp_path, monkeypatch):
    """The fingerprint was taken after the suite ran: files replaced meanwhile (a tokenizer pass over GSM8K takes
    seconds) got a report whose fingerprint vouched for bytes never validated, and training took them."""
    import rlhf_core.data.validation as validation

    train = write(tmp_path / "train.parquet", records(4))
    validate_frames = validation.validate_frames

    def replaced_meanwhile(*args, **kwargs):
        report = validate_frames(*args, **kwargs)
        write(train, records(5))
        return report

    monkeypatch.setattr(validation, "validate_frames", replaced_meanwhile)
    with pytest.raises(validation.DataChangedError, match="data validation: the data files changed since they were "
                                                          "validated"):
        validate_dataset(train)


# ---------------------------------------------------------------------------------------------
# Prompts trained without a ground truth (a reward model at rule_coef=0, or a custom reward function)


def test_prompts_alone_fail_by_default_and_pass_without_a_ground_truth(char_tokenizer):
    train = pd.DataFrame(records(4)).drop(columns=["reward_model"])
    assert failed(validate_frames(train)) == [("column_exists", "reward_model", "train")]
    assert validate_frames(train, kind="auto").kind is None  # told by its columns: neither kind
    report = validate_frames(train, kind="auto", ground_truth_required=False, tokenizer=char_tokenizer,
                             max_prompt_length=512)
    assert report.kind == "prompt" and report.success, report.summary()
    assert [o.column for o in report.find("column_exists")] == ["data_source", "prompt"]
    assert not any(o.column == "ground_truth" for o in report.results)
    assert "train: not_null [ground_truth] (rows may go without a ground truth: a reward model at " \
        "reward_model.rule_coef=0 or a custom reward function scores them)" in report.skipped
    assert any(item.startswith("train: data_source_known, ground_truth_numeric (no 'reward_model' column")
               for item in report.skipped)
    for name in ("prompt_has_user_turn", "prompt_user_content_non_empty", "problem_id_unique",
                 "prompt_length_within_limit"):
        assert report.find(name)[0].success, name  # the other checks still run
    # ... and still fail: a blank prompt, an over-long one, a leaked validation row, a repeated id
    bad = train.copy()
    bad.at[1, "prompt"] = [{"role": "user", "content": " "}]
    bad.at[2, "extra_info"] = {**bad.at[2, "extra_info"], "index": 0}
    val = pd.DataFrame(records(2, "test", 50)).drop(columns=["reward_model"])
    val.at[1, "prompt"] = train.at[3, "prompt"]
    report = validate_frames(bad, val, ground_truth_required=False, tokenizer=char_tokenizer, max_prompt_length=40)
    assert sorted(failed(report)) == [
        ("no_train_val_leakage", "prompt_asked", "val"),
        ("problem_id_unique", "problem_id", "train"),
        ("prompt_length_within_limit", "prompt_tokens", "train"),
        ("prompt_length_within_limit", "prompt_tokens", "val"),
        ("prompt_user_content_non_empty", "prompt_user_content", "train"),
    ]


def test_prompts_without_a_reward_model_column_are_told_how_they_pass(tmp_path, capsys):
    """Prompts alone, validated by their columns, were reported as neither kind with chosen/rejected missing, and
    nothing said that a run without a ground truth needs no reward_model column."""
    note = ("  'prompt' without 'reward_model', 'chosen' or 'rejected' is prompt data without a ground truth, which "
            "trains with a custom reward function or a reward model at reward_model.rule_coef=0 and needs no "
            "'reward_model' column: validate it so with {}")
    train = pd.DataFrame(records(3)).drop(columns=["reward_model"])
    assert note.format("ground_truth_required=False") in validate_frames(train, kind="auto").summary().splitlines()
    alone = tmp_path / "alone.parquet"
    train.to_parquet(alone)
    assert validate([str(alone)]) == 1
    assert note.format("--no-ground-truth") in capsys.readouterr().out.splitlines()
    assert validate([str(alone), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["notes"] == [note.format("--no-ground-truth").strip()]
    # no prompt column: nothing tells it as prompts; prompt data: no note
    assert validate_frames(pd.DataFrame([{"text": "hello"}]), kind="auto").notes == []
    # GSM8K as released: its converter writes prompt data
    assert validate_frames(pd.DataFrame([{"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}]),
                           kind="auto").notes == [
        "'question' and 'answer' are GSM8K as released: rlhf gsm8k --input <its folder> --output <folder> writes "
        "them as prompt data (verl's columns), the files to validate and train on"]
    assert validate_frames(pd.DataFrame(records(3)), kind="auto").notes == []
    assert validate_frames(train, kind="auto", ground_truth_required=False).notes == []


@pytest.mark.parametrize("missing", [None, float("nan"), np.float32("nan")], ids=["none", "nan", "nan32"])
def test_a_missing_ground_truth_fails_not_null_by_default_and_passes_without_one(missing):
    rows = records(3)
    rows[1]["reward_model"]["ground_truth"] = missing  # a NaN is a float column's null: missing, not "nan"
    frame = pd.DataFrame(rows)
    report = validate_frames(frame)
    assert failed(report) == [("not_null", "ground_truth", "train")]
    assert report.failures[0].examples == [(1, None)]
    assert report.find("ground_truth_numeric")[0].statistics["missing_count"] == 1
    relaxed = validate_frames(frame, ground_truth_required=False)
    assert relaxed.success, relaxed.summary()
    assert relaxed.find("not_null", "ground_truth") == []
    assert relaxed.find("not_null", "reward_model") == []
    numeric = relaxed.find("ground_truth_numeric")[0]
    assert numeric.statistics["element_count"] == 2  # the rows with a ground truth
    assert "rows with a ground truth" in numeric.description


def test_a_nan_ground_truth_read_from_parquet_is_missing(tmp_path):
    rows = records(3)
    for row, truth in zip(rows, [7.0, float("nan"), 9.0]):  # a float field: its NaN stands for no value
        row["reward_model"]["ground_truth"] = truth
    path = write(tmp_path / "train.parquet", rows)
    assert failed(validate_dataset(path)) == [("not_null", "ground_truth", "train")]
    assert validate_dataset(path, ground_truth_required=False).success


def test_a_source_without_a_rule_needs_one_only_where_a_ground_truth_is_graded():
    rows = records(4)
    rows[1]["data_source"], rows[1]["reward_model"]["ground_truth"] = "my/chat", None  # the reward model's alone
    assert sorted(failed(validate_frames(pd.DataFrame(rows)))) == [("data_source_known", "data_source", "train"),
                                                                   ("not_null", "ground_truth", "train")]
    report = validate_frames(pd.DataFrame(rows), ground_truth_required=False)
    assert report.success, report.summary()
    known = report.find("data_source_known")[0]
    assert known.statistics["element_count"] == 3 and known.description.endswith("(rows with a ground truth)")
    rows[2]["data_source"] = "my/chat"  # graded by a built-in rule, which this source has none of
    report = validate_frames(pd.DataFrame(rows), ground_truth_required=False)
    assert failed(report) == [("data_source_known", "data_source", "train")]
    assert report.failures[0].examples == [(2, "my/chat")]
    assert "FAILED data_source_known [train.data_source]" in report.summary()
    assert "data_source_known" in report.to_html()
    custom = validate_frames(pd.DataFrame(rows), ground_truth_required=False, custom_reward=True)
    assert custom.success, custom.summary()
    assert "train: data_source_known, ground_truth_numeric (a custom reward function scores every source)" \
        in custom.skipped


def test_each_split_may_need_a_ground_truth_and_says_why():
    """A pipeline whose trainer takes prompts without a ground truth (a reward model at rule_coef=0) while its
    evaluation grades the validation set with the built-in rule: the splits differ, and the refusal gives the
    evaluation's reason."""
    train = pd.DataFrame(records(4)).drop(columns=["reward_model"])
    rows = records(3, "test", 50)
    rows[2]["reward_model"]["ground_truth"] = None
    val = pd.DataFrame(rows)
    why = "the evaluation grades every validation problem against it"
    report = validate_frames(train, val, ground_truth_required=(False, True), ground_truth_reason=(None, why))
    assert failed(report) == [("not_null", "ground_truth", "val")]
    assert report.failures[0].examples == [(2, None)]
    assert f"FAILED not_null [val.ground_truth] (expect_column_values_to_not_be_null): 1 of 3 rows fail (33.3%): " \
        f"reward_model.ground_truth is never null ({why})" in report.summary().splitlines()
    assert "train: not_null [ground_truth] (rows may go without a ground truth: a reward model at " \
        "reward_model.rule_coef=0 or a custom reward function scores them)" in report.skipped
    # a validation file without the column: the column is missing, for that reason
    report = validate_frames(train, val.drop(columns=["reward_model"]), ground_truth_required=(False, True),
                             ground_truth_reason=(None, why))
    assert failed(report) == [("column_exists", "reward_model", "val")]
    assert f"FAILED column_exists [val.reward_model] (expect_column_to_exist): column 'reward_model' is missing " \
        f"({why})" in report.summary().splitlines()
    # the reason is said only where the split needs a ground truth; without one it reads as before
    assert validate_frames(train, val.drop(index=[2]), ground_truth_required=(False, True),
                           ground_truth_reason=(why, why)).success
    plain = validate_frames(pd.DataFrame(rows))
    assert failed(plain) == [("not_null", "ground_truth", "train")]
    assert plain.failures[0].description == "reward_model.ground_truth is never null"


def test_a_custom_reward_on_the_command_line_takes_prompts_without_a_ground_truth(tmp_path, capsys):
    """The trainer with a custom reward function takes rows without a ground truth; `rlhf validate --custom-reward`
    refused them unless --no-ground-truth was also given."""
    alone = tmp_path / "alone.parquet"
    pd.DataFrame(records(3)).drop(columns=["reward_model"]).to_parquet(alone)
    rows = records(3, "test", 20)
    rows[0]["reward_model"]["ground_truth"] = None
    partial = write(tmp_path / "partial.parquet", rows)
    assert validate([str(alone), "--val", str(partial), "--custom-reward"]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "(prompt data)" in out and "skipped: val: not_null [ground_truth]" in out
    assert validate([str(partial), "--custom-reward", "--no-ground-truth"]) == 0  # the same, said twice
    capsys.readouterr()
    assert validate([str(partial)]) == 1  # the built-in rule: still needed
    assert "FAILED not_null [train.ground_truth]" in capsys.readouterr().out
    result = _run_cli("--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "implies --no-ground-truth" in text


def test_the_command_line_takes_prompts_without_a_ground_truth(tmp_path, capsys):
    alone = tmp_path / "alone.parquet"
    pd.DataFrame(records(3)).drop(columns=["reward_model"]).to_parquet(alone)
    rows = records(3, "test", 20)
    rows[0]["reward_model"]["ground_truth"] = None
    partial = write(tmp_path / "partial.parquet", rows)
    assert validate([str(alone)]) == 1
    assert "neither prompt nor preference data" in capsys.readouterr().out
    assert validate([str(partial)]) == 1
    assert "FAILED not_null [train.ground_truth]" in capsys.readouterr().out
    assert validate([str(alone), "--val", str(partial), "--no-ground-truth"]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "(prompt data)" in out and "skipped: val: not_null [ground_truth]" in out
    result = _run_cli(str(partial), "--no-ground-truth", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["success"] is True


# ---------------------------------------------------------------------------------------------
# Prompt length with a real tokenizer


def test_token_counts_use_the_chat_template_when_present(char_tokenizer, chat_tokenizer_dir):
    from transformers import AutoTokenizer

    frame = pd.DataFrame(records(2))
    content = frame["prompt"][0][0]["content"]
    plain = flatten(frame, char_tokenizer)["prompt_tokens"].tolist()
    templated = flatten(frame, AutoTokenizer.from_pretrained(str(chat_tokenizer_dir)))[
        "prompt_tokens"
    ].tolist()
    assert plain[0] == len(content)
    assert templated[0] == len(f"<user>{content}\n<assistant>")
    # the chat template's keywords, as the trainer passes them (data.apply_chat_template_kwargs)
    thinking = AutoTokenizer.from_pretrained(str(chat_tokenizer_dir))
    thinking.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
                              "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}")
    off = flatten(frame, thinking, template_kwargs={"enable_thinking": False})["prompt_tokens"].tolist()
    assert off[0] == len(f"<user>{content}\n<assistant><no-think>")


def test_the_command_line_measures_with_the_chat_template_keywords(tmp_path, chat_tokenizer_dir):
    from transformers import AutoTokenizer

    thinking = AutoTokenizer.from_pretrained(str(chat_tokenizer_dir))
    thinking.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
                              "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}")
    thinking.save_pretrained(tmp_path / "tok")
    path = tmp_path / "a.parquet"
    frame = pd.DataFrame(records(1))
    frame.to_parquet(path)
    length = int(flatten(frame, thinking)["prompt_tokens"][0])  # without the keywords
    common = [str(path), "--tokenizer", str(tmp_path / "tok"), "--max-prompt-length", str(length)]
    assert validate(common) == 0
    assert validate([*common, "--chat-template-kwargs", '{"enable_thinking": false}']) == 1  # 10 tokens longer


def test_over_long_prompt_reports_share_over(tmp_path, char_tokenizer):
    rows = records(4)
    rows[2]["prompt"][0]["content"] += " Please show every step of your working." * 5
    limit = max(len(r["prompt"][0]["content"]) for i, r in enumerate(rows) if i != 2)
    path = write(tmp_path / "train.parquet", rows)
    report = validate_dataset(path, tokenizer=char_tokenizer, max_prompt_length=limit)
    assert failed(report) == [("prompt_length_within_limit", "prompt_tokens", "train")]
    outcome = report.failures[0]
    assert outcome.statistics["share_over"] == pytest.approx(0.25)
    assert outcome.statistics["unexpected_count"] == 1
    assert outcome.examples == [(2, len(rows[2]["prompt"][0]["content"]))]
    assert "25.0%" in report.summary()

    tolerant = validate_dataset(
        path, tokenizer=char_tokenizer, max_prompt_length=limit, overlong_tolerance=0.3
    )
    assert tolerant.success
    assert tolerant.find("prompt_length_within_limit")[0].statistics["share_over"] == pytest.approx(0.25)
    # 7 of 10 rows over: a tolerance of 0.7 takes them (1 - 0.7 rounds to 0.30000000000000004 in floats), 0.6 not
    rows = records(10)
    for row in rows[:7]:
        row["prompt"][0]["content"] += " Please show every step of your working."
    path = write(tmp_path / "ten.parquet", rows)
    limit = max(len(row["prompt"][0]["content"]) for row in rows[7:])
    for tolerance, passes in ((0.7, True), (0.6, False)):
        report = validate_dataset(path, tokenizer=char_tokenizer, max_prompt_length=limit,
                                  overlong_tolerance=tolerance)
        assert report.success is passes, tolerance


def test_length_check_needs_tokenizer_and_limit(valid_files, char_tokenizer):
    with pytest.raises(ValueError, match="needs both a tokenizer and the limit"):
        validate_dataset(valid_files[0], max_prompt_length=10)
    with pytest.raises(ValueError, match="needs both a tokenizer and the limit"):
        validate_dataset(valid_files[0], tokenizer=char_tokenizer)


# ---------------------------------------------------------------------------------------------
# Unreadable input


def _missing(folder: Path) -> Path:
    return folder / "absent.parquet"


def _not_parquet(folder: Path) -> Path:
    path = folder / "notes.parquet"
    path.write_text("question,answer\n1+1,2\n")
    return path


def _truncated(folder: Path) -> Path:
    whole = write(folder / "whole.parquet", records(20))
    data = whole.read_bytes()
    path = folder / "cut.parquet"
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize("make", [_missing, _not_parquet, _truncated], ids=lambda f: f.__name__.strip("_"))
def test_unreadable_input(tmp_path, capsys, make):
    path = make(tmp_path)
    with pytest.raises(DataReadError) as caught:
        validate_dataset(path)
    assert caught.value.path == str(path)
    assert "\n" not in caught.value.reason and caught.value.reason

    assert validate([str(path)]) == 2
    captured = capsys.readouterr()
    err_lines = captured.err.strip().splitlines()
    assert len(err_lines) == 1 and str(path) in err_lines[0]
    assert "Traceback" not in captured.err + captured.out


def test_unreadable_val_file(valid_files, tmp_path, capsys):
    assert validate([str(valid_files[0]), "--val", str(_truncated(tmp_path))]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "rlhf_core.data.validation", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_truncated_file_exits_2_without_traceback(tmp_path):
    result = _run_cli(str(_truncated(tmp_path)))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


# ---------------------------------------------------------------------------------------------
# Command line


def test_cli_failing_data_exits_1_and_writes_html(tmp_path):
    rows = records(5)
    _text_ground_truth(rows[4])
    train = write(tmp_path / "train.parquet", rows)
    val = write(tmp_path / "val.parquet", records(2, "test", 0))  # both rows leak
    html_path = tmp_path / "report.html"
    result = _run_cli(
        str(train),
        "--val",
        str(val),
        "--html",
        str(html_path),
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    out = result.stdout
    assert "ground_truth_numeric" in out and "row 4: '12 apples'" in out
    assert "no_train_val_leakage" in out and "row 0:" in out and "row 1:" in out
    assert "Calculating Metrics" not in out + result.stderr and "%|" not in result.stderr
    page = html_path.read_text()
    assert "ground_truth_numeric" in page and "no_train_val_leakage" in page


def test_cli_valid_data_exits_0_with_json(valid_files, chat_tokenizer_dir, capsys):
    train, val = valid_files
    argv = [
        str(train),
        "--val",
        str(val),
        "--tokenizer",
        str(chat_tokenizer_dir),
        "--max-prompt-length",
        "512",
    ]
    assert validate([*argv, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["success"] is True and payload["kind"] == "prompt"
    assert payload["datasets"][0]["path"] == str(train)
    checks = [r["expectation_config"]["meta"]["check"] for r in payload["datasets"][0]["result"]["results"]]
    assert "prompt_length_within_limit" in checks
    assert payload["statistics"]["evaluated_expectations"] == sum(
        len(d["result"]["results"]) for d in payload["datasets"])


def test_cli_rejects_tokenizer_without_limit(valid_files, chat_tokenizer_dir, capsys):
    assert validate([str(valid_files[0]), "--tokenizer", str(chat_tokenizer_dir)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert str(valid_files[0]) in line and "needs both a tokenizer and the limit" in line
    assert validate([str(valid_files[0]), "--max-chars", "100"]) == 2  # a preference-data limit
    assert "--max-chars does not apply to prompt data" in capsys.readouterr().err


def test_cli_errors_name_the_options_the_user_typed(valid_files, chat_tokenizer_dir, capsys):
    train, tokenizer = str(valid_files[0]), str(chat_tokenizer_dir)
    cases = [
        ([train, "--tokenizer", tokenizer],
         "a length limit in tokens needs both a tokenizer and the limit: --tokenizer and --max-prompt-length"),
        ([train, "--max-chars", "100"],
         "--max-chars does not apply to prompt data; limits by kind: prompt data --max-prompt-length (tokens), "
         "preference data --max-length (tokens) or --max-chars (characters)"),
        ([train, "--tokenizer", tokenizer, "--max-prompt-length", "0"],
         "--max-prompt-length must be a positive integer (the length limit), not 0"),
        ([train, "--overlong-tolerance", "1.5"], "--overlong-tolerance must lie in [0, 1], not 1.5"),
    ]
    for argv, message in cases:
        assert validate(argv) == 2, argv
        assert capsys.readouterr().err == f"error: {train}: {message}\n"


def test_library_errors_name_the_parameters(valid_files, char_tokenizer):
    cases = [
        ({"tokenizer": char_tokenizer},
         "a length limit in tokens needs both a tokenizer and the limit: tokenizer and max_prompt_length"),
        ({"max_chars": 100}, "max_chars does not apply to prompt data; limits by kind: prompt data max_prompt_length "
                             "(tokens), preference data max_length (tokens) or max_chars (characters)"),
        ({"tokenizer": char_tokenizer, "max_prompt_length": 0},
         "max_prompt_length must be a positive integer (the length limit), not 0"),
        ({"overlong_tolerance": -0.5}, "overlong_tolerance must lie in [0, 1], not -0.5"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError) as error:
            validate_dataset(valid_files[0], **options)
        assert str(error.value) == message


def test_cli_chat_template_kwargs_must_be_a_json_object(valid_files, capsys):
    for text, reason in [("{x", "not JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
                                 "(char 1)): '{x'"),
                         ("[1]", "a JSON object of keywords is needed, e.g. '{\"enable_thinking\": false}', "
                                 "not '[1]'"),
                         # an argument of apply_chat_template itself, which measured every prompt cut to 5 tokens
                         ('{"max_length": 5}', "max_length is an argument of apply_chat_template, not a variable of the "
                                               "chat template: every prompt is rendered as the trainer renders it (with "
                                               "the generation prompt, to token ids, cut to the length given)")]:
        with pytest.raises(SystemExit) as stop:
            validate([str(valid_files[0]), "--chat-template-kwargs", text])
        assert stop.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.endswith(f"error: argument --chat-template-kwargs: {reason}"), last


# ---------------------------------------------------------------------------------------------
# Fingerprint and HTML


def test_fingerprint_is_order_independent_and_byte_sensitive(tmp_path):
    a = tmp_path / "a.parquet"
    b = tmp_path / "b.parquet"
    a.write_bytes(b"first file bytes")
    b.write_bytes(b"second file bytes")
    assert fingerprint([a, b]) == fingerprint([b, a]) == fingerprint([str(b), str(a)])
    assert len(fingerprint([a, b])) == 64
    assert fingerprint([a]) != fingerprint([a, b])
    before = fingerprint([a, b])
    data = bytearray(b.read_bytes())
    data[3] ^= 0x01
    b.write_bytes(bytes(data))
    assert fingerprint([a, b]) != before
    with pytest.raises(DataReadError):
        fingerprint([tmp_path / "nope.parquet"])


def test_a_file_named_relative_to_the_working_directory_fingerprints_as_its_absolute_name(tmp_path, monkeypatch):
    """Two files of one name, one given relative: sorted by the path as written, "/.../srv/train.parquet" came
    before "data/train.parquet", and by the absolute paths after "/.../home/proj/data/train.parquet": the lineage,
    which fingerprints the absolute paths recorded, said data the run validated had changed since."""
    elsewhere, here = tmp_path / "srv" / "train.parquet", tmp_path / "home" / "proj" / "data" / "train.parquet"
    for path, text in ((elsewhere, b"one half"), (here, b"the other half")):
        path.parent.mkdir(parents=True)
        path.write_bytes(text)
    monkeypatch.chdir(tmp_path / "home" / "proj")
    # worked out by hand: the files in the order of their absolute paths, each after its length in 8 bytes
    expected = hashlib.sha256((14).to_bytes(8, "big") + b"the other half" + (8).to_bytes(8, "big") + b"one half")
    assert fingerprint([elsewhere, "data/train.parquet"]) == fingerprint([elsewhere, here]) == expected.hexdigest()


def test_the_splits_fingerprint_tells_which_file_is_in_which_split(tmp_path):
    """The retraining gate and the data-changed check hold a run to it: a re-split of the same files is new data."""
    a, b, c = (tmp_path / f"{name}.parquet" for name in "abc")
    for path in (a, b, c):
        path.write_bytes(f"bytes of {path.name}".encode())
    assert splits_fingerprint([a, b], c) == splits_fingerprint([b, a], [c])  # order within a split: no matter
    assert len({splits_fingerprint([a, b], c), splits_fingerprint([a, c], b), splits_fingerprint([b, c], a),
                splits_fingerprint([a, b, c]), splits_fingerprint([a, b, c], [])}) == 4  # none and no files: alike
    assert fingerprint([a, b, c]) not in {splits_fingerprint([a, b], c), splits_fingerprint([a, c], b)}


def test_html_report_is_gx_data_docs_naming_failed_rows():
    rows = records(4)
    _no_user_turn(rows[1])
    _unknown_source(rows[2])
    val = records(3, "test", 30)
    _unknown_source(val[0])
    report = validate_frames(pd.DataFrame(rows), pd.DataFrame(val), paths=("data/<train>.parquet", None))
    page = report.to_html()
    assert page.lstrip().startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "Great Expectations" in page
    assert "prompt_has_user_turn" in page and "data_source_known" in page and "nobody/knows" in page
    # GX's query for the failing rows of each expectation: train rows 1 and 2, val row 0
    assert "df.filter(items=[1], axis=0)" in page and "df.filter(items=[2], axis=0)" in page
    assert "df.filter(items=[0], axis=0)" in page
    assert page.count("Evaluated Expectations") == 2  # one overview per dataset
    assert "data/&lt;train&gt;.parquet" in page and "<train>" not in page


def test_html_report_of_a_split_of_several_files_maps_its_rows_to_their_files(tmp_path):
    """GX's page indexes the joined table: a bad row in the second file showed as index 6 ("df.filter(items=[6])")
    under "train: a.parquet,b.parquet (10 rows)", with nothing on the page saying which file's row that is."""
    a = write(tmp_path / "a.parquet", records(5))
    rows = records(5, offset=5)
    _unknown_source(rows[1])
    b = write(tmp_path / "b.parquet", rows)
    page = validate_dataset([a, b]).to_html()
    assert "df.filter(items=[6], axis=0)" in page
    assert f"train: {a}: rows 0-4; {b}: rows 5-9, indexed on from one file to the next (10 rows)" in page
    assert f"train: {a} (5 rows)" in validate_dataset(a).to_html()  # one file: as it was


# ---------------------------------------------------------------------------------------------
# The trainer's view: its row numbers, its token counts, its columns, its chat template


def test_an_error_gx_keeps_under_a_metric_id_is_the_reported_failure():
    from types import SimpleNamespace

    from rlhf_core.data.validation import Outcome, _describe_failure

    config = SimpleNamespace(kwargs={"column": "pair"}, meta={"check": "no_duplicate_pairs"}, type="expect_x",
                             description="no_duplicate_pairs: each triple appears once")
    metric = "MetricConfigurationID(metric_name='column_values.unique.condition', metric_domain_kwargs_id=())"
    for flag in (True, "True"):  # "True": a result read back from its JSON
        nested = {metric: {"raised_exception": flag, "exception_message": "unhashable type:\n 'list'",
                           "exception_traceback": "Traceback ..."}}
        outcome = Outcome.of(SimpleNamespace(expectation_config=config, result={}, success=False,
                                             exception_info=nested), "train")
        assert outcome.statistics == {"error": "unhashable type: 'list'"}
        assert _describe_failure(outcome) == ("error: unhashable type: 'list' (the check could not run: "
                                              "each triple appears once)")
    quiet = {"raised_exception": False, "exception_message": None, "exception_traceback": None}
    outcome = Outcome.of(SimpleNamespace(expectation_config=config, result={"unexpected_count": 0},
                                         success=True, exception_info=quiet), "train")
    assert outcome.statistics == {"unexpected_count": 0}


def test_rows_without_an_index_are_numbered_per_file_as_the_trainer_numbers_them(tmp_path, char_tokenizer):
    from rlhf_core.config import DataConfig
    from rlhf_core.data.dataset import RLHFDataset

    first, second = records(2, "test", 0), records(2, "test", 10)
    for row in first + second:
        del row["extra_info"]["index"]
    files = [write(tmp_path / "a.parquet", first), write(tmp_path / "b.parquet", second)]
    report = validate_dataset(files)
    # each file numbers its rows from 0: joined rows 0, 1, 2, 3 are openai/gsm8k/0, /1, /0, /1
    assert failed(report) == [("problem_id_unique", "problem_id", "train")]
    outcome = report.failures[0]
    assert outcome.statistics["unexpected_count"] == 4
    assert outcome.examples == [(0, f"{SOURCE}/0"), (1, f"{SOURCE}/1"), (2, f"{SOURCE}/0")]
    dataset = RLHFDataset(files, char_tokenizer, DataConfig(), key="data.val_files")
    ids = [f"{row['data_source']}/{row['index']}" for row in dataset.rows]
    assert ids == [f"{SOURCE}/0", f"{SOURCE}/1", f"{SOURCE}/0", f"{SOURCE}/1"]

    rows = records(3)
    rows[0]["extra_info"]["index"] = 1
    rows[1]["extra_info"]["index"] = None  # row 1 of its file: openai/gsm8k/1, the id row 0 already has
    outcome = validate_frames(pd.DataFrame(rows)).find("problem_id_unique")[0]
    assert not outcome.success
    assert outcome.examples == [(0, f"{SOURCE}/1"), (1, f"{SOURCE}/1")]


def test_a_file_without_extra_info_beside_one_with_it_passes_as_the_trainer_takes_it(tmp_path, char_tokenizer,
                                                                                     capsys):
    """extra_info is optional, as in verl: the trainer numbers a file's rows without it by their row in that file,
    but validation refused such a file beside one with the column (column_in_every_file). Its ids are checked."""
    from rlhf_core.config import DataConfig
    from rlhf_core.data.dataset import RLHFDataset

    first = write(tmp_path / "a.parquet", records(2, offset=10))  # indices 10, 11
    second = write(tmp_path / "b.parquet", [{k: v for k, v in row.items() if k != "extra_info"}
                                            for row in records(3, offset=20)])  # rows 0, 1, 2 of their file
    report = validate_dataset([first, second])
    assert report.success, report.summary()
    assert not report.find("column_in_every_file")
    assert validate([str(first), str(second)]) == 0
    assert capsys.readouterr().out.startswith("Dataset validation PASSED")
    dataset = RLHFDataset([str(first), str(second)], char_tokenizer, DataConfig())
    assert [row["id"] for row in dataset.rows] == [f"{SOURCE}/{i}" for i in (10, 11, 0, 1, 2)]
    # a third file whose index 1 is the second file's row 1: the id repeats, in validation as in the trainer
    third = write(tmp_path / "c.parquet", records(1, offset=1))
    report = validate_dataset([first, second, third])
    assert failed(report) == [("problem_id_unique", "problem_id", "train")]
    assert report.failures[0].examples == [(3, f"{SOURCE}/1"), (5, f"{SOURCE}/1")]


@pytest.fixture(scope="module")
def no_system_tokenizer(char_tokenizer):
    """The character tokenizer with a chat template that refuses a system turn (as Gemma's does)."""
    tokenizer = copy.deepcopy(char_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}"
        "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tokenizer


def test_prompt_the_chat_template_refuses_fails_with_the_templates_error(no_system_tokenizer):
    rows = records(3)
    rows[1]["prompt"] = [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "What is 2+2?"}]
    report = validate_frames(pd.DataFrame(rows), tokenizer=no_system_tokenizer, max_prompt_length=500)
    assert failed(report) == [("prompt_renders", "prompt_template_error", "train")]
    assert report.failures[0].examples == [(1, "TemplateError: System role not supported")]
    assert report.failures[0].statistics["unexpected_count"] == 1
    assert "row 1: 'TemplateError: System role not supported'" in report.summary()
    length = report.find("prompt_length_within_limit")[0]
    assert length.success and length.statistics["missing_count"] == 1  # the refused row has no length
    content = rows[0]["prompt"][0]["content"]
    tokens = flatten(pd.DataFrame(rows), no_system_tokenizer)["prompt_tokens"]
    assert tokens[0] == len(f"<user>{content}\n<assistant>")


@pytest.fixture(scope="module")
def bos_tokenizer():
    """A character tokenizer whose encoder puts <s> first, without a chat template."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, "<s>": 2}
    for code in list(range(32, 127)) + [10]:
        vocab.setdefault(chr(code), len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                   bos_token="<s>")


def test_prompt_tokens_are_the_trainers_count_without_an_encoder_bos(bos_tokenizer):
    rows = records(2)
    rows[0]["prompt"] = [{"role": "user", "content": "y" * 40}]
    rows[1]["prompt"] = [{"role": "user", "content": "z" * 10}]
    # the trainer joins the contents and encodes them without special tokens: 40 tokens, not 41 with <s>
    assert validate_frames(pd.DataFrame(rows), tokenizer=bos_tokenizer, max_prompt_length=40).success
    report = validate_frames(pd.DataFrame(rows), tokenizer=bos_tokenizer, max_prompt_length=39)
    assert failed(report) == [("prompt_length_within_limit", "prompt_tokens", "train")]
    assert report.failures[0].examples == [(0, 40)]


def _renamed(rows: list[dict]) -> list[dict]:
    """``rows`` with the prompt in 'question' and the data source in 'source'."""
    names = {"prompt": "question", "data_source": "source"}
    return [{names.get(key, key): value for key, value in row.items()} for row in rows]


def test_the_configured_prompt_and_source_columns_are_the_ones_checked():
    rows = _renamed(records(3))
    rows[2]["source"] = "nobody/knows"
    keys = {"prompt_key": "question", "reward_fn_key": "source"}
    report = validate_frames(pd.DataFrame(rows), **keys)
    assert failed(report) == [("data_source_known", "source", "train")]
    assert report.failures[0].examples == [(2, "nobody/knows")]
    assert [o.column for o in report.find("column_exists")] == ["source", "question", "reward_model"]
    assert report.find("prompt_has_user_turn")[0].statistics["element_count"] == 3  # read from 'question'
    assert report.find("problem_id_unique")[0].success  # openai/gsm8k/0, openai/gsm8k/1, nobody/knows/2
    # with the default columns the same table lacks both
    assert failed(validate_frames(pd.DataFrame(rows))) == [("column_exists", "data_source", "train"),
                                                            ("column_exists", "prompt", "train")]


def test_the_data_step_validates_the_columns_the_trainer_reads(tmp_path, monkeypatch, chat_tokenizer_dir):
    import steps.validate_data as step
    from rlhf_core.config import load_config

    train = write(tmp_path / "train.parquet", _renamed(records(4)))
    val = write(tmp_path / "val.parquet", _renamed(records(2, "test", 40)))
    cfg = load_config([f"data.train_files={train}", f"data.val_files={val}",
                       f"data.tokenizer={chat_tokenizer_dir}", "data.prompt_key=question",
                       "data.reward_fn_key=source"])
    monkeypatch.setattr(step, "log_metadata", lambda metadata: None)  # no step context outside a pipeline run
    result, _html, fingerprint_ = step.validate_data.entrypoint(cfg.to_dict())
    assert result["success"] is True and fingerprint_ == splits_fingerprint(train, val)
    checked = {r["expectation_config"]["kwargs"].get("column") for d in result["datasets"]
               for r in d["result"]["results"]}
    assert {"question", "source"} <= checked and not {"prompt", "data_source"} & checked


def _without_ability(rows: list[dict]) -> list[dict]:
    return [{key: value for key, value in row.items() if key != "ability"} for row in rows]


def test_ability_is_optional_and_checked_where_it_is_there():
    """Neither the trainer nor a reward function reads 'ability' (nor does verl's RLHFDataset need it): a table
    without it passes; where it is there it is still never null."""
    report = validate_frames(pd.DataFrame(_without_ability(records(3))))
    assert report.success, report.summary()
    assert [o.column for o in report.find("column_exists")] == ["data_source", "prompt", "reward_model"]
    assert [o.column for o in report.find("not_null")] == ["data_source", "prompt", "reward_model", "ground_truth"]
    rows = records(3)
    rows[1]["ability"] = None
    report = validate_frames(pd.DataFrame(rows))
    assert failed(report) == [("not_null", "ability", "train")]
    assert [o.column for o in report.find("not_null")] == [
        "data_source", "prompt", "ability", "reward_model", "ground_truth"]
    assert report.failures[0].statistics["unexpected_count"] == 1
    # a table of neither kind is told what prompt data needs: 'ability' is not among it
    summary = validate_frames(pd.DataFrame([{"text": "hello"}]), kind="auto").summary()
    assert "  prompt data needs the columns data_source, prompt, reward_model; " in summary


def test_the_command_line_and_the_data_step_take_prompts_without_ability(tmp_path, monkeypatch, capsys,
                                                                         chat_tokenizer_dir):
    import steps.validate_data as step
    from rlhf_core.config import load_config

    train = write(tmp_path / "train.parquet", _without_ability(records(4)))
    val = write(tmp_path / "val.parquet", _without_ability(records(2, "test", 40)))
    assert validate([str(train), "--val", str(val)]) == 0
    assert capsys.readouterr().out.startswith("Dataset validation PASSED")
    cfg = load_config([f"data.train_files={train}", f"data.val_files={val}", f"data.tokenizer={chat_tokenizer_dir}"])
    monkeypatch.setattr(step, "log_metadata", lambda metadata: None)  # no step context outside a pipeline run
    result, _html, _fingerprint = step.validate_data.entrypoint(cfg.to_dict())
    assert result["success"] is True


def test_the_command_line_takes_the_prompt_and_source_columns(tmp_path, capsys):
    train = write(tmp_path / "train.parquet", _renamed(records(3)))
    assert validate([str(train)]) == 1  # the default columns are not there
    assert "column_exists" in capsys.readouterr().out
    assert validate([str(train), "--prompt-key", "question", "--reward-fn-key", "source"]) == 0


# ---------------------------------------------------------------------------------------------
# Real data


def _gsm8k_rows(path: Path, split: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as handle:
        for index, line in enumerate(handle):
            item = json.loads(line)
            truth = extract_final_answer(item["answer"])
            rows.append(make_record(item["question"], item["answer"], truth, split, index, SOURCE))
    return rows


def test_real_gsm8k_rows_pass(tmp_path, char_tokenizer, gsm8k_dir):
    test_file = gsm8k_dir / "test.jsonl"
    rows = _gsm8k_rows(test_file, "test")
    path = write(tmp_path / "test.parquet", rows)
    report = validate_dataset(path, tokenizer=char_tokenizer, max_prompt_length=4096)
    assert report.success, report.summary()
    assert report.datasets[0].rows == len(rows)
    assert report.find("ground_truth_numeric")[0].statistics["element_count"] == len(rows)


def test_a_plain_string_prompt_is_one_user_turn_as_the_trainer_takes_it(char_tokenizer):
    """The RL dataset reads a string prompt as one user turn; validation does too, and measures it that way: with
    a character tokenizer and no chat template, the 46 characters of the question are its 46 tokens."""
    question = "Tom has 1 apple. How many apples does he have?"
    assert len(question) == 46
    row = {**records(1)[0], "prompt": question}
    assert failed(validate_frames(pd.DataFrame([row]), tokenizer=char_tokenizer, max_prompt_length=46)) == []
    assert failed(validate_frames(pd.DataFrame([row]), tokenizer=char_tokenizer, max_prompt_length=45)) == [
        ("prompt_length_within_limit", "prompt_tokens", "train")]
    row["prompt"] = json.dumps([{"role": "user", "content": question}])  # the JSON text of messages: refused
    assert ("prompt_is_non_empty_message_list", "prompt_problem", "train") in failed(
        validate_frames(pd.DataFrame([row])))
    row["prompt"] = 5  # not text and not messages: still malformed
    assert ("prompt_is_non_empty_message_list", "prompt_problem", "train") in failed(
        validate_frames(pd.DataFrame([row])))


# ---------------------------------------------------------------------------------------------
# Nothing to measure against the length limit


def _every_prompt(value):
    def mutate(rows):
        for row in rows:
            row["prompt"] = value(row)
        return rows
    return mutate


@pytest.mark.parametrize("mutate, failing, why", [
    (lambda rows: rows[:0], ("has_rows", None), "the table has no rows"),
    (_every_prompt(lambda row: [{"content": row["prompt"][0]["content"]}]),
     ("prompt_is_non_empty_message_list", "prompt_problem"), "every row is null, malformed"),
    (_every_prompt(lambda row: [row["prompt"][0]["content"]]),
     ("prompt_is_non_empty_message_list", "prompt_problem"), "every row is null, malformed"),
    (_every_prompt(lambda row: row["prompt"][0]["content"].encode() + b"\xff"),
     ("prompt_is_non_empty_message_list", "prompt_problem"), "every row is null, malformed"),
])
def test_no_prompt_to_measure_fails_and_says_why_without_a_traceback(tmp_path, capsys, chat_tokenizer_dir,
                                                                    mutate, failing, why):
    """An empty file, or one where every prompt is malformed (no role, strings for messages, bytes), with a
    token limit: exit 1 with the failed checks, and the limit's line says no row was measured."""
    path = tmp_path / "train.parquet"
    rows = mutate(records(3))
    (pd.DataFrame(rows) if rows else pd.DataFrame(records(3)).iloc[:0]).to_parquet(path)
    args = [str(path), "--tokenizer", str(chat_tokenizer_dir), "--max-prompt-length", "500"]
    assert validate(args) == 1
    out = capsys.readouterr().out
    assert out.startswith("Dataset validation FAILED: 1 of ")
    assert [line.split(" (")[0] for line in out.splitlines() if line.startswith("FAILED")] == [
        f"FAILED {failing[0]} [train.{failing[1]}]" if failing[1] else f"FAILED {failing[0]} [train]"]
    assert "  train: no row could be measured against the limit (prompt is at most 500 tokens): " + why in out
    assert "% of rows over the limit" not in out
    assert validate([*args, "--json"]) == 1
    payload = json.loads(capsys.readouterr().out)
    assert payload["success"] is False and payload["statistics"]["unsuccessful_expectations"] == 1


def test_share_over_counts_only_the_measured_prompts(char_tokenizer):
    """Two of four prompts malformed, one of the other two over the limit: half the measured rows are over."""
    rows = records(4)
    rows[0]["prompt"] = [{"content": "no role"}]
    rows[1]["prompt"] = [{"role": "user", "content": None}]
    rows[3]["prompt"][0]["content"] += "!" * 200
    limit = len(rows[2]["prompt"][0]["content"])  # no chat template: the content's characters
    report = validate_frames(pd.DataFrame(rows), tokenizer=char_tokenizer, max_prompt_length=limit)
    length = report.find("prompt_length_within_limit")[0]
    assert not length.success and length.statistics["share_over"] == pytest.approx(0.5)
    assert length.examples == [(3, limit + 200)]
    malformed = report.find("prompt_is_non_empty_message_list")[0]
    assert [row for row, _ in malformed.examples] == [0, 1]


def test_numeric_ground_truths_are_read_as_the_rule_writes_them():
    """A float column's 13.0 is the answer 13 to the rule (it passes), a float32 2.5 is 2.5 (not 2.5 plus float32's
    rounding), while the text "13.0" fails: the rule, comparing strings, matches it to no '#### 13'."""
    rows = records(4)
    for row, truth in zip(rows, [13.0, 2.5, 7.0, 0.1]):
        row["reward_model"]["ground_truth"] = truth
    frame = pd.DataFrame(rows)
    frame["reward_model"] = [{**cell, "ground_truth": np.float32(cell["ground_truth"])} for cell in frame["reward_model"]]
    report = validate_frames(frame)
    assert report.find("ground_truth_numeric")[0].success, report.summary()
    assert list(flatten(frame)["ground_truth"]) == ["13", "2.5", "7", "0.1"]


def test_a_bad_row_of_the_second_file_is_named_by_its_file_and_row(tmp_path):
    """Two training files (of one name, in two folders, as verl's layouts have them) are joined into one table:
    row 0 of the second was reported as "row 5"."""
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "math").mkdir()
    first = write(tmp_path / "gsm8k" / "train.parquet", records(5))
    rows = records(3, offset=5)
    _text_ground_truth(rows[0])
    second = write(tmp_path / "math" / "train.parquet", rows)
    report = validate_dataset([first, second])
    assert failed(report) == [("ground_truth_numeric", "ground_truth", "train")]
    assert report.failures[0].examples == [(5, "12 apples")]  # the joined table's row, for code that reads it
    assert f"    {second} row 0: '12 apples'" in report.summary().splitlines()
    single = validate_dataset(second)
    assert "    row 0: '12 apples'" in single.summary().splitlines()


def test_the_ground_truth_check_passes_exactly_the_texts_a_right_answer_matches(tmp_path):
    from rlhf_core.rewards.gsm8k import compute_score, unanswerable

    # (stored ground truth, the right answer as a response writes numbers (None: it is no number), and whether
    # the rule scores that answer)
    cases = [("$12", "12", True), ("1,000", "1000", True), (" 7 ", "7", True), ("2.5", "2.5", True),
             ("-3", "-3", True), ("4.0", "4", False), (".5", "0.5", False), ("1.2.3", None, False),
             ("12 apples", "12", False)]
    for truth, answer, scores in cases:  # what the rule itself does with each, worked out by hand above
        assert answer is None or compute_score(f"#### {answer}", truth) == (1.0 if scores else 0.0), truth
        assert (unanswerable(truth) is None) == scores, truth
    rows = records(len(cases))
    for row, (truth, _, _) in zip(rows, cases):
        row["reward_model"]["ground_truth"] = truth
    report = validate_dataset(write(tmp_path / "train.parquet", rows))
    [check] = report.failures  # the rows whose answer no response can give, and nothing else
    assert check.name == "ground_truth_numeric"
    assert check.statistics["unexpected_count"] == 4
    assert check.examples == [(5, "4.0"), (6, ".5"), (7, "1.2.3")]  # the first three of the four


def test_a_float32_ground_truth_field_read_back_with_digits_of_its_own_fails_as_in_preflight(tmp_path):
    """A parquet float32 field's 0.1 reads back as 0.10000000149011612, which no answer matches (preflight refuses
    it); 2.5 and 18 read back as written. The validation read the widened value as a fine number."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    frame = pd.DataFrame(records(3))
    truth = pa.struct([("style", pa.string()), ("ground_truth", pa.float32())])
    table = pa.Table.from_pandas(frame.drop(columns=["reward_model"]), preserve_index=False).append_column(
        "reward_model", pa.array([{"style": "rule", "ground_truth": v} for v in (0.1, 2.5, 18.0)], type=truth))
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    report = validate_dataset(path)
    [check] = report.failures
    assert check.name == "ground_truth_numeric" and check.statistics["unexpected_count"] == 1
    assert check.examples == [(0, "0.10000000149011612 (a float32 field read back as a double)")]


def test_a_reward_model_that_is_not_a_mapping_is_named_with_its_rows(tmp_path, capsys):
    """A reward_model column of JSON text (a CSV round trip) or of bare answers read as 'ground_truth is null' with
    the value None shown: the check names the cells themselves."""
    rows = records(3)
    texts = [json.dumps(row["reward_model"]) for row in rows]
    path = tmp_path / "train.parquet"
    pd.DataFrame(rows).assign(reward_model=texts).to_parquet(path)  # a parquet column is all text or all structs
    report = validate_dataset(path)
    [outcome] = report.find("reward_model_is_mapping")
    assert not outcome.success
    assert outcome.examples == [(0, texts[0]), (1, texts[1]), (2, texts[2])]
    assert validate([str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAILED reward_model_is_mapping [train.reward_model_non_mapping]" in out
    assert f"row 1: {texts[1]!r}" in out
    # in memory a column may mix them: only the rows that are not mappings fail
    frame = pd.DataFrame(records(4))
    frame["reward_model"] = [frame["reward_model"][0], "11", 11, frame["reward_model"][3]]
    [outcome] = validate_frames(frame).find("reward_model_is_mapping")
    assert outcome.examples == [(1, "11"), (2, 11)]
    assert outcome.statistics["unexpected_count"] == 2
    # a well-formed table has the check, and passes it
    assert validate_dataset(write(tmp_path / "good.parquet", records(3))).find("reward_model_is_mapping")[0].success


def test_a_null_extra_info_passes_as_the_trainer_reads_it_an_empty_one(tmp_path):
    """A row written without extra_info beside rows with it is a null cell, which the trainer reads as {} (numbered
    by its row in its file), as it does a file without the column: no finding."""
    rows = records(3, offset=10)
    rows[1]["extra_info"] = None
    path = write(tmp_path / "train.parquet", rows)
    report = validate_dataset(path)
    assert report.success, report.summary()
    assert [o.column for o in report.find("not_null")] == ["data_source", "prompt", "ability", "reward_model",
                                                            "ground_truth"]
    assert report.find("extra_info_is_mapping")[0].success
    # the others keep their integer index: problem ids as the trainer builds them, not source/10.0
    assert flatten(read_parquet(path))["problem_id"].tolist() == [f"{SOURCE}/10", f"{SOURCE}/1", f"{SOURCE}/12"]
    rows = records(2, offset=10)
    rows[1]["extra_info"]["index"] = None  # a null field in one row, as a null cell
    path = write(tmp_path / "index.parquet", rows)
    assert flatten(read_parquet(path))["problem_id"].tolist() == [f"{SOURCE}/10", f"{SOURCE}/1"]


def test_an_extra_info_that_is_not_a_mapping_is_named_with_its_rows(tmp_path, capsys):
    """The trainer refuses text or a number in extra_info (it has no index to read); validation let it pass."""
    rows = records(3)
    path = tmp_path / "train.parquet"
    pd.DataFrame(rows).assign(extra_info=[None, "hard", "easy"]).to_parquet(path)
    report = validate_dataset(path)
    assert failed(report) == [("extra_info_is_mapping", "extra_info_non_mapping", "train")]
    [outcome] = report.failures
    reason = ("extra_info is a str, not a mapping: store e.g. {'index': 0, 'split': 'train'} (a parquet struct), "
              "or leave the cell null")
    assert outcome.examples == [(1, reason), (2, reason)]
    assert validate([str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAILED extra_info_is_mapping [train.extra_info_non_mapping]" in out and str(path) in out
    assert "row 1: \"extra_info is a str, not a mapping: store e.g." in out  # the shown text is cut short
    json_text = pd.DataFrame(rows).assign(extra_info=[json.dumps(row["extra_info"]) for row in rows])
    [outcome] = validate_frames(json_text).find("extra_info_is_mapping")
    assert [row for row, _ in outcome.examples] == [0, 1, 2]
    assert outcome.examples[0][1].startswith("extra_info is the JSON text of a mapping, not a mapping: parse it")


def test_an_empty_parquet_map_in_extra_info_is_named_a_map(tmp_path):
    """A parquet map column (Spark's MapType) reads back as (key, value) pairs, an empty map as []: the column's
    type, not the cell, says it is a map, so an empty one is named a map too (not "a list")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = records(2)
    table = pa.Table.from_pandas(pd.DataFrame(rows).drop(columns=["extra_info"]), preserve_index=False)
    maps = pa.array([[], [("index", 1)]], pa.map_(pa.string(), pa.int64()))
    pq.write_table(table.append_column("extra_info", maps), tmp_path / "train.parquet")
    [outcome] = validate_dataset(tmp_path / "train.parquet").find("extra_info_is_mapping")
    reason = ("extra_info is a parquet map, which verl's reader cannot read: write a struct (e.g. a dict "
              "{'index': 0, 'split': 'train'} per row from pandas, or a StructType column from Spark)")
    assert outcome.examples == [(0, reason), (1, reason)]


def test_the_data_step_fails_where_filtering_over_long_prompts_leaves_too_few(tmp_path, monkeypatch,
                                                                             chat_tokenizer_dir):
    """With data.filter_overlong_prompts the step let every prompt be over the limit (tolerance 1): a training set
    the filter empties, or leaves short of a batch, passed here and failed only in the smoke test, after the
    pipeline had trained its reward model."""
    import steps.validate_data as step
    from rlhf_core.config import load_config

    train, val = records(4), records(2, "test", 40)
    for row in train[2:] + val:
        row["prompt"][0]["content"] += " Think of the apples in the shop." * 6
    rendered = [len(f"<user>{row['prompt'][0]['content']}\n<assistant>") for row in train + val]  # TEMPLATE, by chars
    assert max(rendered[:2]) <= 200 < min(rendered[2:])  # two short training prompts, every other one long
    files = [f"data.train_files={write(tmp_path / 'train.parquet', train)}",
             f"data.val_files={write(tmp_path / 'val.parquet', val)}", f"data.tokenizer={chat_tokenizer_dir}",
             "data.max_prompt_length=200", "data.filter_overlong_prompts=true",
             "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "critic.ppo_micro_batch_size_per_gpu=1"]
    monkeypatch.setattr(step, "log_metadata", lambda metadata: None)  # no step context outside a pipeline run
    with pytest.raises(step.DataValidationError) as error:
        step.validate_data.entrypoint(load_config([*files, "data.train_batch_size=4"]).to_dict())
    message = str(error.value)
    assert "FAILED prompts_left_after_filter [train.prompt_within_limit]" in message
    assert "FAILED prompts_left_after_filter [val.prompt_within_limit]" in message
    assert "2 left (at least 4 prompt(s) of at most 200 tokens" in message
    assert "0 left (at least 1 prompt(s) of at most 200 tokens" in message
    # a batch the kept prompts fill, and a validation prompt within the limit, pass
    val[0]["prompt"] = copy.deepcopy(records(1, "test", 40)[0]["prompt"])
    write(tmp_path / "val.parquet", val)
    result, _html, _fingerprint = step.validate_data.entrypoint(load_config([*files, "data.train_batch_size=2"]).to_dict())
    assert result["success"] is True
    # kept, not dropped (truncated): every prompt may be over the limit
    files[4] = "data.filter_overlong_prompts=false"
    cfg = load_config([*files, "data.train_batch_size=4", "data.truncation=left"])
    assert step.validate_data.entrypoint(cfg.to_dict())[0]["success"] is True


def test_a_prompt_of_exactly_the_limit_counts_as_kept(char_tokenizer):
    """The trainer drops a prompt only when it is longer than data.max_prompt_length: one of exactly that many
    tokens trains, so it counts towards the batch the filter must leave."""
    train = pd.DataFrame(records(2))
    # without a chat template a prompt is its one message's text, a token a character; the two questions differ
    # only in one-digit numbers, so both are as long
    [limit] = {len(row["prompt"][0]["content"]) for row in records(2)}
    [at] = validate_frames(train, tokenizer=char_tokenizer, max_prompt_length=limit,
                           min_kept=(2, None)).find("prompts_left_after_filter")
    assert at.success and at.statistics["observed_value"] == 2
    [under] = validate_frames(train, tokenizer=char_tokenizer, max_prompt_length=limit - 1,
                              min_kept=(2, None)).find("prompts_left_after_filter")
    assert not under.success and under.statistics["observed_value"] == 0


def test_a_prompt_repeated_with_another_ground_truth_fails_with_both_rows(tmp_path):
    """The same prompt twice with two answers passed: one of the rows rewards the right answer as wrong. A prompt
    repeated with the same answer (4 and "4" read alike), or under another system turn, is not a conflict."""
    rows = records(6)
    rows[4]["prompt"] = copy.deepcopy(rows[1]["prompt"])
    rows[4]["reward_model"]["ground_truth"] = "99"
    rows[5]["prompt"] = copy.deepcopy(rows[2]["prompt"])  # a plain repeat: same answer
    rows[5]["reward_model"]["ground_truth"] = "7"  # 2 * 2 + 3, as row 2's
    rows[3]["prompt"] = [{"role": "system", "content": "Be brief."}, *copy.deepcopy(rows[1]["prompt"])]
    rows[3]["reward_model"]["ground_truth"] = "98"  # another conversation, so no conflict
    report = validate_dataset(write(tmp_path / "train.parquet", rows))
    assert failed(report) == [("prompt_has_one_ground_truth", "prompt_conflicting_truths", "train")]
    first = rows[1]["reward_model"]["ground_truth"]  # "5": (2*1+3)
    assert first == "5"
    assert report.failures[0].examples == [(1, "5 | 99"), (4, "5 | 99")]
    # one file's messages all get a key one of them has (a name), null on the others: the prompt is the same
    extra = records(4)
    extra[3]["prompt"] = [{**extra[3]["prompt"][0], "name": "x"}]
    extra[2]["prompt"] = copy.deepcopy(rows[1]["prompt"])
    extra[2]["reward_model"]["ground_truth"] = "99"
    joined = validate_dataset([write(tmp_path / "a.parquet", rows[:2]), write(tmp_path / "b.parquet", extra[2:])])
    assert failed(joined) == [("prompt_has_one_ground_truth", "prompt_conflicting_truths", "train")]
    frame = pd.DataFrame(records(2))
    frame["prompt"] = [frame["prompt"][0]] * 2
    frame["reward_model"] = [{"style": "rule", "ground_truth": 4}, {"style": "rule", "ground_truth": "4"}]
    assert validate_frames(frame).find("prompt_has_one_ground_truth")[0].success
    # truths the rule reads as one answer (it drops "," and "$") agree; a repeat under another data source is
    # graded by another rule, so neither is it a conflict
    frame["reward_model"] = [{"style": "rule", "ground_truth": "1,000"}, {"style": "rule", "ground_truth": "1000"}]
    assert validate_frames(frame).find("prompt_has_one_ground_truth")[0].success
    frame["reward_model"] = [{"style": "rule", "ground_truth": "$5"}, {"style": "rule", "ground_truth": "5"}]
    assert validate_frames(frame).find("prompt_has_one_ground_truth")[0].success
    frame["reward_model"] = [{"style": "rule", "ground_truth": "5"}, {"style": "rule", "ground_truth": "6"}]
    assert not validate_frames(frame).find("prompt_has_one_ground_truth")[0].success
    frame["data_source"] = ["openai/gsm8k", "other/source"]
    assert validate_frames(frame, custom_reward=True).find("prompt_has_one_ground_truth")[0].success


def test_an_optional_column_of_one_file_only_is_checked_in_that_file(tmp_path):
    """Joined with a file that has 'ability', a file without it (optional, as alone it passes) failed not_null on
    each of its rows; the nulls of the file that has it still fail, named by file and row."""
    with_ability = records(3)
    without = _without_ability(records(2, offset=10))
    first, second = write(tmp_path / "a.parquet", with_ability), write(tmp_path / "b.parquet", without)
    report = validate_dataset([first, second])
    assert report.success, report.summary()
    assert validate_dataset([second, first]).success  # either order
    with_ability[1]["ability"] = None
    write(first, with_ability)
    report = validate_dataset([second, first])
    assert failed(report) == [("not_null", "ability", "train")]
    assert report.failures[0].examples == [(3, None)]  # the second file's row 1, after the first's two rows
    assert report.failures[0].statistics["unexpected_count"] == 1
    assert f"{first} row 1: None" in report.summary()


def test_conditional_checks_use_gx_condition_objects_not_the_deprecated_pandas_strings(tmp_path):
    """The checks restricted to some rows (the files that have a column; the rows with a ground truth) passed
    pandas query strings with condition_parser="pandas", deprecated in GX 1.9 and removed in GX 2.0 (pytest's
    settings and the suite's run hid the warning)."""
    rows = records(3)
    rows[1]["data_source"], rows[1]["reward_model"]["ground_truth"] = "my/chat", None  # graded by no rule
    partial = [{k: v for k, v in row.items() if k != "reward_model"} for row in _without_ability(records(2, offset=10))]
    files = [write(tmp_path / "a.parquet", rows), write(tmp_path / "b.parquet", partial)]
    import great_expectations.expectations  # noqa: F401  (first: importing GX sets warning filters of its own)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strict = validate_dataset(files)  # ability and reward_model in the first file only
        lenient = validate_dataset(files, ground_truth_required=False)
    deprecated = [str(w.message) for w in caught if "condition_parser" in str(w.message)
                  or "row_condition" in str(w.message)]
    assert deprecated == []
    conditional = [(item.expectation_config.meta["check"], item.expectation_config.kwargs["column"],
                    item.result["element_count"])
                   for report in (strict, lenient) for item in report.gx_results["train"].results
                   if item.expectation_config.kwargs.get("row_condition") is not None]
    # the rows each condition keeps, counted by hand: ability and reward_model in the 3 rows of the first file;
    # a ground truth in 2 of them
    assert sorted(conditional) == sorted([
        ("not_null", "ability", 3), ("not_null", "reward_model", 3), ("not_null", "ground_truth", 3),  # strict
        ("not_null", "ability", 3), ("data_source_known", "data_source", 2),  # lenient
        ("ground_truth_numeric", "ground_truth", 2),
    ])
    assert [o.examples for o in strict.find("not_null", "ground_truth")] == [[(1, None)]]
    json.dumps(strict.to_dict())  # the conditions serialise with the result (the step's artifact)
    assert "ability" in strict.to_html()


def test_a_required_column_one_file_of_a_split_lacks_is_named_with_the_file(tmp_path):
    """Joined with files that have it, a file without 'reward_model' (or 'data_source') showed as nulls on each of its
    rows, in reward_model and in its ground truth, and the file went unnamed."""
    first = write(tmp_path / "a.parquet", records(2))
    second = write(tmp_path / "b.parquet", [{k: v for k, v in row.items() if k != "reward_model"}
                                            for row in records(3, offset=10)])
    third = write(tmp_path / "c.parquet", records(1, offset=20))
    report = validate_dataset([first, second, third])
    assert failed(report) == [("column_in_every_file", "reward_model_missing_from", "train")]
    outcome = report.failures[0]
    assert outcome.examples == [(2, str(second))]  # the file, once, by its first row (the first file has two)
    assert outcome.statistics["unexpected_count"] == 3
    assert (f"FAILED column_in_every_file [train.reward_model_missing_from] (expect_column_values_to_be_null): file "
            f"{second} lacks column 'reward_model', which the split's other files have (3 rows without it): add the "
            "column to it") in report.summary().splitlines()
    assert f"{second} row 0" not in report.summary()  # no row-by-row nulls
    # the others' nulls still fail, by file and row
    rows = records(1, offset=20)
    rows[0]["reward_model"]["ground_truth"] = None
    write(third, rows)
    assert sorted(failed(validate_dataset([first, second, third]))) == [
        ("column_in_every_file", "reward_model_missing_from", "train"), ("not_null", "ground_truth", "train")]
    # two files without a column, in the validation split; the column a run without a ground truth needs not
    val = [write(tmp_path / f"v{i}.parquet", [{k: v for k, v in row.items() if k != "data_source"}
                                               for row in records(1, "test", 50 + i)]) for i in range(2)]
    val.insert(1, write(tmp_path / "v.parquet", records(1, "test", 60)))
    report = validate_dataset(first, val, ground_truth_required=False)
    assert failed(report) == [("column_in_every_file", "data_source_missing_from", "val")]
    assert report.failures[0].examples == [(0, str(val[0])), (2, str(val[2]))]
    assert f"files {val[0]}, {val[2]} lack column 'data_source', which the split's other files have (2 rows " \
        "without it): add the column to them" in report.summary()
    assert validate_dataset([first, second], ground_truth_required=False).success
    # more files lacking it than a failure shows examples of: every one is named
    lacking = [write(tmp_path / f"w{i}.parquet", [{k: v for k, v in row.items() if k != "data_source"}
                                                  for row in records(1, "test", 70 + i)]) for i in range(4)]
    report = validate_dataset(first, [val[1], *lacking], ground_truth_required=False)
    assert f"files {', '.join(map(str, lacking))} lack column 'data_source'" in report.summary()


def test_the_command_line_validates_splits_of_several_files(tmp_path, capsys):
    """data.train_files and data.val_files are lists, but the command took one file a split (a second was an
    argparse error): ids repeated across files, or a question of the second training file in the validation set,
    could not be checked from it."""
    first, second = write(tmp_path / "a.parquet", records(3)), write(tmp_path / "b.parquet", records(2))
    val = write(tmp_path / "val.parquet", records(2, "test", 50))
    leaking = write(tmp_path / "leak.parquet", records(1, "test", 1))  # second's row 1 (index 1) again
    assert validate([str(first), "--val", str(val)]) == 0
    assert capsys.readouterr().out.startswith("Dataset validation PASSED")
    assert validate([str(first), str(second), "--val", str(val), str(leaking)]) == 1
    out = capsys.readouterr().out
    assert f"  train: {first},{second} (5 rows)" in out
    assert "FAILED problem_id_unique [train.problem_id]" in out
    assert f"{second} row 0: '{SOURCE}/0'" in out
    assert "FAILED no_train_val_leakage [val.prompt_asked]" in out
    assert f"{leaking} row 0: " in out


def test_a_malformed_prompt_is_shown_with_what_is_wrong_with_it(tmp_path, capsys):
    """A message without 'content', or a number for a role, showed as 'row N: -1': the report says which message
    and which key, as the trainer would."""
    rows = records(5)
    rows[1]["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user"}]
    rows[2]["prompt"] = [{"role": "user", "content": "What is 2 + 2?", "name": "x"}, {"content": "hi"}]
    rows[3]["prompt"] = json.dumps(rows[3]["prompt"])
    frame = pd.DataFrame(rows)
    report = validate_frames(frame)
    assert failed(report) == [("prompt_is_non_empty_message_list", "prompt_problem", "train")]
    assert report.failures[0].examples == [
        (1, "prompt message 1 has no 'content'"), (2, "prompt message 1 has no 'role'"),
        (3, "prompt is the JSON text of a message list: store the list itself (json.loads before writing)")]
    frame.drop(index=3).to_parquet(tmp_path / "train.parquet")  # parquet fills a struct's missing keys with nulls
    assert validate([str(tmp_path / "train.parquet")]) == 1
    out = capsys.readouterr().out
    assert "row 1: \"prompt message 1 has a null 'content'\"" in out
    assert "row 2: \"prompt message 1 has a null 'role'\"" in out


def test_roles_outside_the_chat_format_fail_with_the_roles_named():
    """A ShareGPT conversion's 'human'/'gpt' roles, or 'User', passed wherever a 'user' turn was there too: a chat
    template writes an unknown role as text (SmolLM2's as '<|im_start|>gpt') or drops the message."""
    rows = records(5)
    rows[1]["prompt"] = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "gpt", "content": "4"},
                         {"role": "user", "content": "And 3 + 3?"}]
    rows[2]["prompt"] = [{"role": "User", "content": "What is 2 + 2?"}, {"role": "user", "content": "And 3 + 3?"},
                         {"role": "Human", "content": "x"}, {"role": "User", "content": "y"}]
    rows[3]["prompt"] = [{"role": role, "content": "c"} for role in ("system", "user", "assistant", "tool", "user")]
    report = validate_frames(pd.DataFrame(rows))
    assert failed(report) == [("prompt_roles_known", "prompt_unknown_roles", "train")]
    assert report.failures[0].examples == [(1, "gpt"), (2, "User, Human")]


def test_a_json_lines_file_is_named_as_such(tmp_path, capsys):
    """It was "not a readable parquet file (... Parquet magic bytes not found in footer. Either the file is corrupted
    or this is not a parquet file.)"."""
    lines = tmp_path / "train.jsonl"
    pd.DataFrame(records(2)).to_json(lines, orient="records", lines=True)
    assert validate([str(lines)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: cannot read {lines}: not a readable parquet file (it is JSON Lines text, not parquet: write it as a "
        f"parquet file, e.g. pandas.read_json('{lines}', lines=True).to_parquet('train.parquet') (chat messages as "
        "lists of {role, content} objects, reward_model as an object), and name that file)")


def test_a_folder_of_shards_is_refused_with_the_files_it_holds(tmp_path, capsys):
    """A folder (verl's shards) was 'is a directory, expected a parquet file', with no word of what to give."""
    folder = tmp_path / "train"
    folder.mkdir()
    for name in ("part-1.parquet", "part-0.parquet"):
        write(folder / name, records(2))
    assert validate([str(folder)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: cannot read {folder}: is a directory, expected a parquet file: name its files (it holds "
        "part-0.parquet, part-1.parquet)")
    assert validate([str(folder / "part-0.parquet"), str(folder / "part-1.parquet")]) == 1  # ids 0, 1 twice
    capsys.readouterr()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataReadError, match=r"is a directory with no \.parquet file \(it is empty\), expected a "
                                            r"parquet file: name parquet files$"):
        validate_dataset(empty)


def test_gsm8k_as_released_is_sent_to_rlhf_gsm8k_and_a_folder_without_parquet_says_what_it_holds(tmp_path, capsys):
    """GSM8K's train.jsonl had the generic pandas.read_json(...).to_parquet advice, whose file is then refused as
    GSM8K as released; the release folder "name its files (it holds no .parquet file)"."""
    release = tmp_path / "gsm8k"
    release.mkdir()
    for split in ("train", "test"):
        (release / f"{split}.jsonl").write_text(json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"}) + "\n")
    advice = ("GSM8K as released (question, answer), not verl's prompt data: write verl's columns (prompt, "
              "data_source, reward_model.ground_truth from the answer's '####' line) with rlhf gsm8k --input "
              f"{release} --output <folder>, and name the train.parquet and test.parquet it writes")
    assert validate([str(release / "train.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: cannot read {release / 'train.jsonl'}: not a readable "
                                               f"parquet file (it is JSON Lines of {advice})")
    assert validate([str(release)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: cannot read {release}: is a directory, expected a parquet "
                                               f"file: it holds {advice}")
    other = tmp_path / "other"
    (other / "nested").mkdir(parents=True)
    (other / "rows.csv").write_text("prompt\nx\n")
    assert validate([str(other)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: cannot read {other}: is a directory with no .parquet file "
                                               "(it holds nested/, rows.csv), expected a parquet file: name parquet "
                                               "files")


def test_a_pass_without_a_length_limit_says_the_lengths_went_unchecked(valid_files, capsys):
    """Without --tokenizer and --max-prompt-length the command said PASSED and nothing of lengths, though the
    trainer stops on a prompt over data.max_prompt_length (data.truncation=error)."""
    train, val = valid_files
    assert validate([str(train), "--val", str(val)]) == 0
    assert ("  skipped: train, val: prompt_length_within_limit (no length limit given: needs --tokenizer and "
            "--max-prompt-length)") in capsys.readouterr().out.splitlines()
    assert validate_frames(pd.DataFrame(records(2))).skipped == [
        "train: prompt_length_within_limit (no length limit given: needs tokenizer and max_prompt_length)"]


_VALIDATES_UNDER_INFO_LOGGING = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout)  # as a ZenML step's log has it
logging.captureWarnings(True)
from rlhf_core.data.validation import validate_dataset
print("passed" if validate_dataset(sys.argv[1], sys.argv[2]).success else "failed")
logging.getLogger("rlhf.test").info("a line of the caller's own")
"""


def test_a_validation_under_info_logging_writes_none_of_gxs_own_lines(valid_files):
    """A ZenML step logs at INFO: the demo's validate_data step showed some 220 lines GX logs as it imports (its
    docs registry skipping closures, a temporary docs folder) and google.api_core's warning about the Python
    version, before the validation's own result. A first validation in a fresh process under INFO logging now
    writes only what the caller logs."""
    result = subprocess.run([sys.executable, "-c", _VALIDATES_UNDER_INFO_LOGGING, *map(str, valid_files)],
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["passed", "INFO:rlhf.test:a line of the caller's own"], result.stdout
