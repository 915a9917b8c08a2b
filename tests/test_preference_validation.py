"""Tests for the Great Expectations checks on preference (chosen/rejected) parquet files."""

from __future__ import annotations

import collections
import copy
import json

import pandas as pd
import pytest
from test_validation import char_tokenizer, chat_tokenizer_dir, failed, plant, write  # noqa: F401 (fixtures)

from rlhf_core.cli.data import validate
from rlhf_core.data.schema import PREFERENCE_COLUMNS
from rlhf_core.data.validation import (
    ValidationReport,
    detect_kind,
    splits_fingerprint,
    validate_dataset,
    validate_frames,
    validate_preference_files,
)

SOURCE = "synthetic/arithmetic"


def pairs(n: int = 5, offset: int = 0, split: str = "train") -> list[dict]:
    rows = []
    for i in range(offset, offset + n):
        rows.append({
            "prompt": [{"role": "user", "content": f"What is {i} + {i + 3}?"}],
            "chosen": f"{i} + {i + 3} = {2 * i + 3}\n#### {2 * i + 3}",
            "rejected": f"{i} + {i + 3} = {2 * i + 4}\n#### {2 * i + 4}",
            "data_source": SOURCE,
            "extra_info": {"split": split, "index": i},
        })
    return rows


def validate_preference_frames(train: pd.DataFrame, val: pd.DataFrame | None = None, **options) -> ValidationReport:
    return validate_frames(train, val, kind="preference", **options)


def test_schema_names_the_five_columns_and_kind_follows_the_columns():
    assert PREFERENCE_COLUMNS == ("prompt", "chosen", "rejected", "data_source", "extra_info")
    assert detect_kind(PREFERENCE_COLUMNS) == "preference"
    assert detect_kind(["prompt", "chosen"]) == "preference"
    assert detect_kind(["prompt", "reward_model", "data_source"]) == "prompt"
    assert detect_kind(["prompt", "data_source", "extra_info"]) is None


def test_valid_pairs_pass(tmp_path):
    train = write(tmp_path / "train.parquet", pairs(6))
    val = write(tmp_path / "val.parquet", pairs(3, offset=100, split="test"))
    report = validate_dataset(train, val, max_chars=200)
    assert report.kind == "preference"
    assert report.success, report.summary()
    names = {o.name for o in report.results}
    assert {"has_rows", "column_exists", "not_null", "prompt_is_non_empty_message_list", "chosen_non_empty",
            "rejected_non_empty", "chosen_differs_from_rejected", "no_duplicate_pairs",
            "no_train_val_leakage", "pair_length_within_limit"} <= names
    assert "ground_truth_numeric" not in names and "data_source_known" not in names
    assert [(o.column, o.success) for o in report.find("column_exists", dataset="train")] == [
        (c, True) for c in PREFERENCE_COLUMNS]
    assert report.find("no_train_val_leakage")[0].dataset == "val"
    assert report.fingerprint == splits_fingerprint(train, val)
    assert "PASSED" in report.summary() and "preference data" in report.summary()
    json.dumps(report.to_dict(), allow_nan=False)


# ---------------------------------------------------------------------------------------------
# One bad row at a time


def _null_chosen(row):
    row["chosen"] = None


def _null_rejected(row):
    row["rejected"] = None


def _empty_chosen(row):
    row["chosen"] = ""


def _blank_rejected(row):
    row["rejected"] = "  \n "


def _identical(row):
    row["rejected"] = row["chosen"]


def _null_prompt(row):
    row["prompt"] = None


def _no_user_turn(row):
    row["prompt"] = [{"role": "system", "content": "Answer briefly."}]


def _blank_user_turn(row):
    row["prompt"] = [{"role": "user", "content": "   "}]


def _null_source(row):
    row["data_source"] = None


def _null_extra_info(row):
    row["extra_info"] = None


# (mutation, expectation, column, reported value); the value of the identical pair is worked out per row
BAD_ROWS = [
    (_null_chosen, "not_null", "chosen", None),
    (_null_rejected, "not_null", "rejected", None),
    (_empty_chosen, "chosen_non_empty", "chosen", ""),
    (_blank_rejected, "rejected_non_empty", "rejected", "  \n "),
    (_identical, "chosen_differs_from_rejected", "chosen,rejected", "same"),
    (_null_prompt, "not_null", "prompt", None),
    (_no_user_turn, "prompt_has_user_turn", "prompt_has_user_turn", False),
    (_blank_user_turn, "prompt_user_content_non_empty", "prompt_user_content", "   "),
    (_null_source, "not_null", "data_source", None),
    (_null_extra_info, "not_null", "extra_info", None),
]


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """One validation run over a table whose row ``i + 1`` carries bad case ``i``, and its rows."""
    rows = plant(pairs(len(BAD_ROWS) + 2), BAD_ROWS)
    return rows, validate_dataset(write(tmp_path_factory.mktemp("bad") / "train.parquet", rows))


def test_bad_rows_fail_exactly_their_expectations(bad):
    _rows, report = bad
    expected: dict[tuple[str, str], list[int]] = {}
    for position, (_mutate, name, column, _value) in enumerate(BAD_ROWS):
        expected.setdefault((name, column), []).append(position + 1)
    got = {(o.name, o.column): [row for row, _ in o.examples] for o in report.failures}
    assert not report.success
    assert got == expected, report.summary()
    for outcome in report.failures:
        assert outcome.statistics["unexpected_count"] == len(expected[(outcome.name, outcome.column)])


@pytest.mark.parametrize(("position", "case"), list(enumerate(BAD_ROWS)),
                         ids=[case[0].__name__.strip("_") for case in BAD_ROWS])
def test_bad_row_is_named_with_its_value(bad, position, case):
    rows, report = bad
    _mutate, name, column, value = case
    if value == "same":
        text = rows[position + 1]["chosen"]
        value = {"chosen": text, "rejected": text}
    [outcome] = report.find(name, column)
    assert (position + 1, value) in outcome.examples
    summary = report.summary()
    assert f"FAILED {name} [train.{column}]" in summary
    assert f"    row {position + 1}: " in summary


def test_duplicate_pairs_name_every_row_of_the_repeated_pair():
    rows = pairs(6)
    rows[4] = copy.deepcopy(rows[1])  # the same prompt, chosen and rejected
    rows[5] = copy.deepcopy(rows[2])
    rows[5]["rejected"] = "another wrong answer\n#### 0"  # same prompt and chosen, another rejected: a new pair
    report = validate_preference_frames(pd.DataFrame(rows))
    assert failed(report) == [("no_duplicate_pairs", "pair", "train")]
    outcome = report.failures[0]
    assert [row for row, _ in outcome.examples] == [1, 4]
    assert outcome.statistics["unexpected_count"] == 2
    assert json.loads(outcome.examples[0][1]) == [rows[1]["prompt"], rows[1]["chosen"], rows[1]["rejected"]]


def test_a_prompt_shared_by_train_and_val_is_caught_where_parquet_gave_its_messages_other_keys(tmp_path):
    """A message with a field the others lack (a name) gives every message of its file that key, null: the same
    prompt in the other split, without it, passed as another prompt, to the suite and to the trainer's check."""
    from rlhf_core.data.preference import PreferenceDataError, check_preference_files

    train, val = pairs(4), pairs(3, offset=50, split="test")
    val[0] = copy.deepcopy(train[1])
    val[2]["prompt"] = [{**val[2]["prompt"][0], "name": "alice"}]
    pd.DataFrame(train).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame(val).to_parquet(tmp_path / "val.parquet")
    stored = pd.read_parquet(tmp_path / "val.parquet")["prompt"][0]
    assert [dict(m) for m in stored] == [{**train[1]["prompt"][0], "name": None}]  # as parquet reads it back
    report = validate_preference_files(tmp_path / "train.parquet", tmp_path / "val.parquet")
    assert failed(report) == [("no_train_val_leakage", "prompt_json", "val")]
    assert report.failures[0].examples == [(0, '[{"content": "What is 1 + 4?", "role": "user"}]')]
    with pytest.raises(PreferenceDataError, match="1 prompt"):
        check_preference_files([tmp_path / "train.parquet"], [tmp_path / "val.parquet"])


def test_prompts_shared_by_train_and_val_name_the_val_rows():
    from pathlib import Path

    from rlhf_core.data.preference import PreferenceDataError, check_preference_frames

    train = pairs(5)
    val = pairs(4, offset=50, split="test")
    val[2] = copy.deepcopy(train[3])  # the same pair
    val[3]["prompt"] = copy.deepcopy(train[0]["prompt"])  # same prompt, other answers: training refuses it
    report = validate_preference_frames(pd.DataFrame(train), pd.DataFrame(val))
    assert failed(report) == [("no_train_val_leakage", "prompt_json", "val")]
    # the prompt as the reward model's trainer keys it: its messages, keys sorted
    assert report.failures[0].examples == [(2, '[{"content": "What is 3 + 6?", "role": "user"}]'),
                                           (3, '[{"content": "What is 0 + 3?", "role": "user"}]')]
    assert report.failures[0].statistics["unexpected_count"] == 2
    with pytest.raises(PreferenceDataError, match="2 prompt"):
        check_preference_frames([(Path("train"), pd.DataFrame(train))], [(Path("val"), pd.DataFrame(val))])


def test_numbers_as_chosen_or_rejected_fail_as_not_text():
    rows = pairs(4)
    rows[1]["chosen"] = 5  # GX's regex reads it as the text "5"; the reward model's trainer refuses it
    rows[2]["rejected"] = 7.5
    report = validate_preference_frames(pd.DataFrame(rows))
    assert failed(report) == [("chosen_is_text", "chosen_non_text", "train"),
                              ("rejected_is_text", "rejected_non_text", "train")]
    assert [o.examples for o in report.failures] == [[(1, 5)], [(2, 7.5)]]
    assert [o.statistics["unexpected_count"] for o in report.failures] == [1, 1]
    summary = report.summary()
    assert "FAILED chosen_is_text [train.chosen_non_text]" in summary and "    row 1: 5" in summary


def test_a_check_gx_cannot_evaluate_reports_the_error_instead_of_a_row_count():
    rows = pairs(3)
    rows[1]["chosen"] = [{"role": "assistant", "content": "9"}]  # messages, not text: unhashable for GX
    rows[1]["rejected"] = [{"role": "assistant", "content": "10"}]
    report = validate_preference_frames(pd.DataFrame(rows))
    [outcome] = report.find("chosen_differs_from_rejected")
    assert not outcome.success
    assert outcome.statistics == {"error": "unhashable type: 'list'"}
    summary = report.summary()
    assert ("FAILED chosen_differs_from_rejected [train.chosen,rejected] "
            "(expect_select_column_values_to_be_unique_within_record): error: unhashable type: 'list' "
            "(the check could not run: chosen and rejected are different texts)") in summary
    assert "None of 0 rows" not in summary
    [not_text] = report.find("chosen_is_text")
    assert not_text.examples == [(1, [{"role": "assistant", "content": "9"}])]


# ---------------------------------------------------------------------------------------------
# Length budget


def test_character_budget_names_the_long_row_with_its_length():
    rows = pairs(4)
    rows[2]["rejected"] = "Let me work through every step very slowly. " * 4 + "#### 7"
    # characters: the user turn, a newline, the longer response
    lengths = [len(r["prompt"][0]["content"]) + 1 + max(len(r["chosen"]), len(r["rejected"])) for r in rows]
    limit = max(length for i, length in enumerate(lengths) if i != 2)
    report = validate_preference_frames(pd.DataFrame(rows), max_chars=limit)
    assert failed(report) == [("pair_length_within_limit", "pair_length", "train")]
    outcome = report.failures[0]
    assert outcome.examples == [(2, lengths[2])]
    assert outcome.statistics["share_over"] == pytest.approx(0.25)
    assert "25.0%" in report.summary() and f"{limit} characters" in report.summary()

    tolerant = validate_preference_frames(pd.DataFrame(rows), max_chars=limit, overlong_tolerance=0.3)
    assert tolerant.success
    assert "25.0% of rows over the limit" in tolerant.summary()


def test_token_budget_counts_the_chat_template_with_the_response(chat_tokenizer_dir):  # noqa: F811
    rows = pairs(3)
    rows[1]["chosen"] = "A much longer chosen answer with all of its working shown. #### 9"
    # as the reward model trains on it: the template's "<role>content\n" per turn and its generation prompt
    # "<assistant>", then the response and EOS (one token each character here)
    tokens = [len(f"<user>{r['prompt'][0]['content']}\n<assistant>{max(r['chosen'], r['rejected'], key=len)}") + 1
              for r in rows]
    limit = tokens[0]
    assert tokens[1] > limit >= tokens[2]
    report = validate_preference_frames(pd.DataFrame(rows), tokenizer=chat_tokenizer_dir, max_length=limit)
    assert failed(report) == [("pair_length_within_limit", "pair_length", "train")]
    assert report.failures[0].examples == [(1, tokens[1])]
    assert f"{limit} tokens" in report.summary()


def test_token_budget_renders_the_template_with_the_trainers_keywords(char_tokenizer):  # noqa: F811
    """``template_kwargs`` (``reward_model.train.apply_chat_template_kwargs``) reach the template as in training:
    here a keyword that writes a preamble, which a budget measured without it would not count."""
    tokenizer = copy.deepcopy(char_tokenizer)
    tokenizer.chat_template = ("{% if preamble %}Think first.\n{% endif %}"
                               "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    rows = pairs(2)
    rows[1]["chosen"] += " Checked."
    lengths = [len(f"Think first.\n<user>{r['prompt'][0]['content']}\n<assistant>"
                   f"{max(r['chosen'], r['rejected'], key=len)}") + 1 for r in rows]
    limit = lengths[1] - 1  # row 1 is one token over once the preamble counts, row 0 within
    assert lengths[0] <= limit
    plain = validate_preference_frames(pd.DataFrame(rows), tokenizer=tokenizer, max_length=limit)
    assert plain.success  # 13 tokens fewer without it
    report = validate_preference_frames(pd.DataFrame(rows), tokenizer=tokenizer, max_length=limit,
                                        template_kwargs={"preamble": True})
    assert failed(report) == [("pair_length_within_limit", "pair_length", "train")]
    assert report.failures[0].examples == [(1, lengths[1])]


def test_a_pair_the_chat_template_refuses_fails_with_the_templates_error(char_tokenizer):  # noqa: F811
    tokenizer = copy.deepcopy(char_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}"
        "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    )
    rows = pairs(3)
    rows[2]["prompt"] = [{"role": "system", "content": "x" * 500}, {"role": "user", "content": "What is 1 + 1?"}]
    report = validate_preference_frames(pd.DataFrame(rows), tokenizer=tokenizer, max_length=100)
    assert failed(report) == [("pair_renders", "pair_template_error", "train")]
    assert report.failures[0].examples == [(2, "TemplateError: System role not supported")]
    length = report.find("pair_length_within_limit")[0]
    assert length.success and length.statistics["missing_count"] == 1  # 500 characters that were never measured


def test_budget_options_are_checked():
    frame = pd.DataFrame(pairs(2))
    with pytest.raises(ValueError, match="tokenizer"):
        validate_preference_frames(frame, max_length=10)
    with pytest.raises(ValueError, match="not both"):
        validate_preference_frames(frame, tokenizer=object(), max_length=10, max_chars=10)
    # called from Python, the errors name the parameters
    cases = [
        ({"max_length": 10}, "a length limit in tokens needs both a tokenizer and the limit: tokenizer and max_length"),
        ({"tokenizer": object(), "max_length": 10, "max_chars": 10},
         "give a token limit (max_length) or a character limit (max_chars), not both"),
        ({"tokenizer": object(), "max_chars": 10}, "a length limit in tokens needs both a tokenizer and the limit: "
                                                    "tokenizer and max_length (max_chars counts characters, without "
                                                    "a tokenizer)"),
        ({"max_prompt_length": 10}, "max_prompt_length does not apply to preference data; limits by kind: prompt "
                                    "data max_prompt_length (tokens), preference data max_length (tokens) or "
                                    "max_chars (characters)"),
        ({"max_chars": 0}, "max_chars must be a positive integer (the length limit), not 0"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError) as error:
            validate_preference_frames(frame, **options)
        assert str(error.value) == message


# ---------------------------------------------------------------------------------------------
# Missing columns and the command line


def test_missing_rejected_is_exit_1_naming_the_column(tmp_path, capsys):
    rows = [{k: v for k, v in row.items() if k != "rejected"} for row in pairs(3)]
    path = write(tmp_path / "train.parquet", rows)
    assert validate([str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAILED column_exists [train.rejected]" in out and "column 'rejected' is missing" in out
    assert "skipped: train: rejected_non_empty (needs column 'rejected')" in out
    assert "skipped: train: chosen_differs_from_rejected (needs column 'rejected')" in out
    assert "skipped: train: no_duplicate_pairs (needs column 'prompt', 'chosen' and 'rejected')" in out
    assert "FAILED column_exists [train.chosen]" not in out


def test_prompt_without_chosen_rejected_or_reward_model_is_exit_1_naming_the_columns(tmp_path, capsys):
    rows = [{k: v for k, v in row.items() if k not in ("chosen", "rejected")} for row in pairs(3)]
    path = write(tmp_path / "train.parquet", rows)
    assert validate([str(path)]) == 1
    out = capsys.readouterr().out
    assert "neither prompt nor preference data" in out
    missing = [line.split("[train.")[1].split("]")[0] for line in out.splitlines()
               if line.startswith("FAILED column_exists")]
    assert missing == ["reward_model", "chosen", "rejected"]


def test_cli_checks_a_preference_file_and_its_val(tmp_path, capsys):
    train = write(tmp_path / "train.parquet", pairs(4))
    val = pairs(2, offset=10, split="test")
    val[1] = copy.deepcopy(pairs(4)[0])
    val_path = write(tmp_path / "val.parquet", val)
    html_path = tmp_path / "report.html"
    assert validate([str(train), "--val", str(val_path), "--max-chars", "500", "--html", str(html_path)]) == 1
    out = capsys.readouterr().out
    assert "FAILED no_train_val_leakage [val.prompt_json]" in out and "    row 1: " in out
    page = html_path.read_text()
    assert "no_train_val_leakage" in page and "df.filter(items=[1], axis=0)" in page

    assert validate([str(train), "--max-chars", "500", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["kind"] == "preference" and payload["success"] is True


def test_cli_rejects_an_option_of_the_other_kind(tmp_path, capsys):
    train = write(tmp_path / "train.parquet", pairs(2))
    folder = tmp_path / "tok"
    folder.mkdir()
    assert validate([str(train), "--tokenizer", str(folder), "--max-prompt-length", "10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {train}: --max-prompt-length does not apply to preference data; limits by kind: prompt "
                   "data --max-prompt-length (tokens), preference data --max-length (tokens) or --max-chars "
                   "(characters)"]
    # each message names the options as typed, not the library's parameters
    cases = [
        (["--max-chars", "10", "--max-length", "10", "--tokenizer", str(folder)],
         "give a token limit (--max-length) or a character limit (--max-chars), not both"),
        (["--max-chars", "0"], "--max-chars must be a positive integer (the length limit), not 0"),
        (["--max-length", "10"], "a length limit in tokens needs both a tokenizer and the limit: --tokenizer and "
                                 "--max-length"),
        (["--tokenizer", str(folder), "--max-chars", "10"], "a length limit in tokens needs both a tokenizer and "
                                                            "the limit: --tokenizer and --max-length (--max-chars "
                                                            "counts characters, without a tokenizer)"),
        (["--tokenizer", str(folder), "--max-length", "-3"],
         "--max-length must be a positive integer (the length limit), not -3"),
    ]
    for options, message in cases:
        assert validate([str(train), *options]) == 2, options
        assert capsys.readouterr().err == f"error: {train}: {message}\n"


def test_validate_preference_files_joins_files_and_fingerprints_them(tmp_path):
    first = write(tmp_path / "a.parquet", pairs(3))
    second = write(tmp_path / "b.parquet", pairs(3, offset=1))  # its rows 0 and 1 repeat rows 1 and 2 of a
    val = write(tmp_path / "val.parquet", pairs(2, offset=40, split="test"))
    report = validate_preference_files([first, second], val, max_chars=300)
    assert failed(report) == [("no_duplicate_pairs", "pair", "train")]
    assert [row for row, _ in report.failures[0].examples] == [1, 2, 3]  # of 6 joined rows: 1, 2 and 3, 4
    assert report.failures[0].statistics["unexpected_count"] == 4
    assert report.datasets[0].rows == 6 and report.datasets[1].rows == 2
    assert report.fingerprint == splits_fingerprint([first, second], val)


# ---------------------------------------------------------------------------------------------
# Real pairs


def test_real_gsm8k_solution_pairs(gsm8k_dir):
    """Every correct x incorrect model solution of a test question; duplicates counted independently."""
    rows = []
    with open(gsm8k_dir / "example_model_solutions.jsonl", encoding="utf-8") as handle:
        for line in handle:
            item = json.loads(line)
            solutions = [v for v in item.values() if isinstance(v, dict) and "solution" in v]
            for good in (s["solution"] for s in solutions if s["is_correct"]):
                for wrong in (s["solution"] for s in solutions if not s["is_correct"]):
                    rows.append({"prompt": [{"role": "user", "content": item["question"]}], "chosen": good,
                                 "rejected": wrong, "data_source": "openai/gsm8k", "extra_info": {"split": "test"}})
    counts = collections.Counter((r["prompt"][0]["content"], r["chosen"], r["rejected"]) for r in rows)
    repeated = [i for i, r in enumerate(rows) if counts[(r["prompt"][0]["content"], r["chosen"], r["rejected"])] > 1]
    assert (len(rows), len(repeated)) == (2429, 6)  # three pairs occur twice (two models wrote the same text)
    report = validate_preference_frames(pd.DataFrame(rows), max_chars=4096)
    assert failed(report) == [("no_duplicate_pairs", "pair", "train")], report.summary()
    assert report.failures[0].statistics["unexpected_count"] == len(repeated)
    assert [row for row, _ in report.failures[0].examples] == repeated[:3]


def test_no_pair_to_measure_fails_and_says_why(tmp_path, capsys):
    """Every prompt a plain string (preference prompts are messages): exit 1, and no pair was measured."""
    rows = pairs(3)
    for row in rows:
        row["prompt"] = row["prompt"][0]["content"]
    path = write(tmp_path / "train.parquet", rows)
    assert validate([str(path), "--max-chars", "500"]) == 1
    out = capsys.readouterr().out
    assert "FAILED prompt_is_non_empty_message_list [train.prompt_problem]" in out
    assert "3 of 3 rows fail (100.0%)" in out
    assert ("  train: no row could be measured against the limit (prompt and the longer response are at most "
            "500 characters): every row is null, malformed") in out


def test_the_pipeline_step_refuses_pairs_on_the_evaluation_questions(tmp_path, monkeypatch):
    """validate_preferences knows the prompts the pipeline evaluates on (data.val_files): a pair on one of their
    questions stops the run, naming the files; pairs apart from them pass."""
    import steps.validate_preferences as step
    from rlhf_core.config import load_config
    from rlhf_core.data.preference import PreferenceDataError, to_frame
    from rlhf_core.data.schema import PROMPT_COLUMNS, make_record

    def pair_file(name, questions):
        path = tmp_path / name
        to_frame([{"question": q, "chosen": "#### 1", "rejected": "#### 2", "group": q} for q in questions],
                 "x", SOURCE).to_parquet(path)
        return path

    def prompt_file(name, questions):
        path = tmp_path / name
        rows = [make_record(q, "#### 1", "1", "test", i, SOURCE) for i, q in enumerate(questions)]
        pd.DataFrame(rows, columns=list(PROMPT_COLUMNS)).to_parquet(path)
        return path

    train, val = pair_file("train.parquet", ["Q1", "Q2"]), pair_file("val.parquet", ["Q3"])
    monkeypatch.setattr(step, "log_metadata", lambda metadata: None)  # no step context outside a pipeline run

    def run(evaluation):
        cfg = load_config([f"data.val_files={evaluation}", f"reward_model.train.train_files={train}",
                           f"reward_model.train.val_files={val}"])
        return step.validate_preferences.entrypoint(cfg.to_dict())

    assert run(prompt_file("apart.parquet", ["Q4", "Q5"])) == splits_fingerprint([train], [val])
    evaluation = prompt_file("test.parquet", ["Q4", "Q3"])
    with pytest.raises(PreferenceDataError, match=r"^1 preference pair\(s\) are on questions of the evaluation "
                                                  r"prompts \(data.val_files\) \(.*test.parquet\), e.g. .*val.parquet: "
                                                  r"'Q3'"):
        run(evaluation)
