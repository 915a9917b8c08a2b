"""Synthetic arithmetic problems: answers read from the question's wording alone, schema, determinism, CLI."""

from __future__ import annotations

import functools
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from rlhf_core.cli import data as cli
from rlhf_core.data import synthetic
from rlhf_core.data.schema import INSTRUCTION, PROMPT_COLUMNS
from rlhf_core.data.synthetic import DATA_SOURCE, build_dataset, build_splits, generate_problems
from rlhf_core.rewards.gsm8k import compute_score

ROOT = Path(__file__).resolve().parents[1]
_STEP = re.compile(r"<<(\d+)([-+*/])(\d+)=(\d+)>>(\d+)")
_SHOWN = re.compile(r"(\d+) ([-+*/]) (\d+) = <<")


def _evaluate(a: int, op: str, b: int) -> int:
    """Integer arithmetic, refusing inexact division."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    assert b != 0 and a % b == 0, f"inexact division {a}/{b}"
    return a // b


# The question read as plain English, written here from the wording and not taken from the generator: a
# problem whose sentence says one operation while its solution does another works out to another answer.
# Each pattern matches a whole sentence; its group is the operand.
_WHO = r"(?:He|She|Then (?:he|she))"
_NOUN = r"[a-z]+(?: [a-z]+)?"  # "apples", "toy cars"
_STEP_SENTENCES = (
    (rf"{_WHO} (?:buys|finds|picks up) (\d+) more\.", "+"),
    (r"[A-Z][a-z]+ gives (?:him|her) (\d+) more\.", "+"),
    (rf"{_WHO} gets (\d+) more {_NOUN} from (?:his|her) [a-z]+\.", "+"),
    (rf"{_WHO} (?:gives away|loses|sells|uses) (\d+)(?: of them| {_NOUN})?\.", "-"),
    (rf"{_WHO} gives (\d+) {_NOUN} to [A-Z][a-z]+\.", "-"),
    (rf"{_WHO}(?: then)? (?:has|ends up with) (\d+) times as many {_NOUN}(?: as before)?\.", "*"),
    (rf"The number of {_NOUN} (?:he|she) has is then multiplied by (\d+)\.", "*"),
    (rf"{_WHO} splits them into (\d+) equal piles and keeps one pile\.", "/"),
    (rf"{_WHO} puts them equally into (\d+) bags and keeps only one bag\.", "/"),
    (rf"{_WHO} shares them equally among (\d+) kids, including (?:him|her)self, and keeps (?:his|her) "
     r"share\.", "/"),
)
# How a question begins: an amount, or a containers holding b objects each, which is the first step, a * b.
_OPENINGS = (
    rf"[A-Z][a-z]+ has (\d+) {_NOUN}\.",
    rf"[A-Z][a-z]+ has (\d+) [a-z]+ of {_NOUN}\. Each [a-z]+ holds (\d+) {_NOUN}\.",
    rf"[A-Z][a-z]+ buys (\d+) [a-z]+ of {_NOUN} with (\d+) {_NOUN} in each [a-z]+\.",
)
_ASKS_FOR_THE_END = (
    rf" How many {_NOUN} does (?:he|she|[A-Z][a-z]+) have "
    r"(?:now|at the end|in total now)\?$"
)


def _read_question(question: str) -> tuple[int, list[tuple[str, int]]]:
    """The start amount and the steps ``(op, operand)`` a question states, from its wording alone."""
    openings = [match for pattern in _OPENINGS if (match := re.match(pattern, question))]
    assert len(openings) == 1, f"no single reading of the opening of {question!r}"
    start, *each = (int(n) for n in openings[0].groups())
    steps = [("*", each[0])] if each else []
    rest = question[openings[0].end() :]
    asks = re.search(_ASKS_FOR_THE_END, rest)
    assert asks, f"the question does not ask for the final amount: {question!r}"
    middle = rest[: asks.start()].strip()
    for sentence in re.split(r"(?<=\.) ", middle) if middle else []:
        readings = [(op, int(m[1])) for pattern, op in _STEP_SENTENCES
                    if (m := re.fullmatch(pattern, sentence))]
        assert len(readings) == 1, f"no single reading of {sentence!r}; add its wording to _STEP_SENTENCES"
        steps += readings
    return start, steps


def check_problem(
    problem: dict, min_ops=1, max_ops=3, min_operand=1, max_operand=20, max_value=999, operations="+-*/"
) -> None:
    """Work the problem out from its question's wording alone and check its answer against that, then check
    that the solution states the same steps, each ``<<a op b=c>>`` annotation right, in GSM8K's format."""
    assert set(problem) == {"question", "solution", "answer"}
    start, read_steps = _read_question(problem["question"])
    amount = start
    for op, b in read_steps:
        assert op in operations
        assert min_operand <= b <= max_operand
        if op in "*/":
            assert b >= 2
        amount = _evaluate(amount, op, b)
        assert 1 <= amount <= max_value, "amounts stay positive and bounded"
    assert min_operand <= start <= max_operand
    assert min_ops <= len(read_steps) <= max_ops
    assert problem["answer"] == str(amount), f"the question works out to {amount}, not {problem['answer']}"

    lines = problem["solution"].split("\n")
    assert lines[-1] == f"#### {problem['answer']}"
    steps = []
    for line in lines[:-1]:
        matches = _STEP.findall(line)
        assert len(matches) == 1, line
        a, op, b, c, shown = matches[0]
        a, b, c, shown = int(a), int(b), int(c), int(shown)
        assert _evaluate(a, op, b) == c, line
        assert shown == c, line
        # The plain-text expression in front of the annotation matches the annotation.
        assert _SHOWN.findall(line) == [(str(a), op, str(b))], line
        steps.append((a, op, b, c))
    for (_, _, _, before), (after_a, _, _, _) in zip(steps, steps[1:]):
        assert after_a == before, "each step continues from the previous result"
    assert steps[0][0] == start, "the solution starts from the question's amount"
    assert [(op, b) for _, op, b, _ in steps] == read_steps, "the solution does the steps the question states"
    assert problem["answer"] == str(steps[-1][3])
    assert compute_score(problem["solution"], problem["answer"], method="strict") == 1.0


def test_default_problems_are_correct():
    problems = generate_problems(500, seed=3)
    for problem in problems:
        check_problem(problem)
    counts = {op: sum(f"<<{op}" in re.sub(r"<<\d+", "<<", p["solution"]) for p in problems) for op in "+-*/"}
    assert all(count > 0 for count in counts.values()), counts
    assert {len(p["solution"].split("\n")) - 1 for p in problems} == {1, 2, 3}


def test_example_style():
    problem = generate_problems(1, seed=0, max_ops=1, operations="+")[0]
    first_line = problem["solution"].split("\n")[0]
    assert re.fullmatch(r"(He|She) has \d+ \+ \d+ = <<\d+\+\d+=\d+>>\d+ [a-z ]+\.", first_line)


@pytest.mark.parametrize(
    ("question", "right", "wrong"),
    [
        (
            "Tom has 7 apples. He buys 5 more. How many apples does he have now?",
            "He has 7 + 5 = <<7+5=12>>12 apples.\n#### 12",
            "He has 7 - 5 = <<7-5=2>>2 apples.\n#### 2",
        ),
        (
            "Anna has 12 stickers. She splits them into 3 equal piles and keeps one pile. "
            "How many stickers does she have now?",
            "She keeps 12 / 3 = <<12/3=4>>4 stickers.\n#### 4",
            "She has 12 * 3 = <<12*3=36>>36 stickers.\n#### 36",
        ),
        (
            "Ben has 4 bags of marbles. Each bag holds 6 marbles. How many marbles does Ben have at the end?",
            "He has 4 * 6 = <<4*6=24>>24 marbles.\n#### 24",
            "He has 4 + 6 = <<4+6=10>>10 marbles.\n#### 10",
        ),
    ],
    ids=["buys", "splits", "containers"],
)
def test_check_problem_reads_the_operation_from_the_wording(question, right, wrong):
    """A solution whose arithmetic is sound but does another operation than the question says is refused."""
    check_problem({"question": question, "solution": right, "answer": right.rsplit(" ", 1)[1]})
    with pytest.raises(AssertionError, match="the question works out to"):
        check_problem({"question": question, "solution": wrong, "answer": wrong.rsplit(" ", 1)[1]})


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    min_ops=st.integers(1, 3),
    extra_ops=st.integers(0, 2),
    max_operand=st.integers(2, 60),
    operations=st.sampled_from(["+", "-", "+-", "*/", "+-*/", "-/", "+*"]),
)
# options under which no draw completes its three steps: starting from 1 or 2, subtracting 1 (or dividing by
# 2) reaches 1 within a step, and then neither applies
@example(seed=0, min_ops=3, extra_ops=0, max_operand=2, operations="-")
@example(seed=0, min_ops=3, extra_ops=0, max_operand=2, operations="-/")
def test_random_options_are_correct(seed, min_ops, extra_ops, max_operand, operations):
    options = {
        "min_ops": min_ops,
        "max_ops": min(3, min_ops + extra_ops),
        "max_operand": max_operand,
        "operations": operations,
    }
    chance = _chance_a_draw_completes(**options)
    # a draw that reaches a dead end is drawn again, up to a thousand times in a row: options whose draws
    # never complete must be refused, and ones whose draws complete often must not be; in between, where
    # a refusal is a matter of luck, the outcome is not defined
    assume(chance == 0 or chance >= 0.01)
    if chance == 0:
        with pytest.raises(ValueError, match="admit"):
            generate_problems(20, seed=seed, **options)
        return
    for problem in generate_problems(20, seed=seed, **options):
        check_problem(problem, **options)


def _chance_a_draw_completes(min_ops, max_ops, max_operand, operations, min_operand=1, max_value=999):
    """The probability that one draw of a problem reaches its last step, by the rules the problems follow:
    an even start and number of steps, then at each step an operation drawn evenly among those that can
    apply, and an operand drawn evenly among those that keep the amount whole, positive and within bounds
    (division by a number smaller than the amount where there is one)."""

    def operands(op, cur):
        low = min_operand if op in "+-" else max(2, min_operand)
        fits = [b for b in range(low, max_operand + 1)
                if 1 <= _evaluate_or_none(cur, op, b) <= max_value]
        if op == "/":
            smaller = [b for b in fits if b < cur]
            return smaller or fits
        return fits

    @functools.cache
    def completes(cur, left):
        if left == 0:
            return 1.0
        usable = [(op, bs) for op in operations if (bs := operands(op, cur))]
        if not usable:
            return 0.0
        return sum(sum(completes(_evaluate(cur, op, b), left - 1) for b in bs) / len(bs)
                   for op, bs in usable) / len(usable)

    starts, counts = range(min_operand, max_operand + 1), range(min_ops, max_ops + 1)
    return sum(completes(a, k) for a in starts for k in counts) / (len(starts) * len(counts))


def _evaluate_or_none(a: int, op: str, b: int) -> int:
    """``a op b``, or 0 (out of bounds) where the division is not exact."""
    return 0 if op == "/" and a % b else _evaluate(a, op, b)


def test_max_value_bounds_intermediates():
    for problem in generate_problems(300, seed=5, min_ops=3, max_ops=3, max_operand=30, max_value=100):
        check_problem(problem, min_ops=3, max_ops=3, max_operand=30, max_value=100)


def test_a_product_may_reach_max_value_exactly():
    # the only problem these options allow: start 2, times 2 = 4, which max_value 4 admits
    problem = generate_problems(1, seed=0, min_ops=1, max_ops=1, min_operand=2, max_operand=2, max_value=4,
                                operations="*")[0]
    assert problem["answer"] == "4"
    check_problem(problem, min_ops=1, max_ops=1, min_operand=2, max_operand=2, max_value=4, operations="*")


def test_deterministic_per_seed_and_different_across_seeds():
    assert generate_problems(50, seed=7) == generate_problems(50, seed=7)
    assert generate_problems(50, seed=7) != generate_problems(50, seed=8)
    assert build_splits(40, 20, seed=1) == build_splits(40, 20, seed=1)
    assert build_splits(40, 20, seed=1) != build_splits(40, 20, seed=2)


def test_splits_are_distinct_and_test_split_is_stable():
    splits = build_splits(300, 100, seed=0, max_ops=1, max_operand=5)
    train = [p["question"] for p in splits["train"]]
    test = [p["question"] for p in splits["test"]]
    assert len(set(train)) == len(train) == 300
    assert len(set(test)) == len(test) == 100
    assert not set(train) & set(test)
    # The test split does not depend on how many training problems are asked for.
    assert build_splits(10, 100, seed=0, max_ops=1, max_operand=5)["test"] == splits["test"]


def test_unique_and_exclude():
    problems = generate_problems(200, seed=1, max_ops=1, max_operand=3, operations="+", unique=True)
    questions = [p["question"] for p in problems]
    assert len(set(questions)) == 200
    excluded = set(questions[:50])
    again = generate_problems(100, seed=1, max_ops=1, max_operand=3, operations="+", exclude=excluded)
    assert not excluded & {p["question"] for p in again}


def test_exclude_compares_questions_as_the_validation_does():
    # a question written in other case or spacing (as a hand-edited prompt file may hold it) is the same question
    # to the train/val overlap check, so it is kept out too
    first = [p["question"] for p in generate_problems(20, seed=1, max_ops=1, max_operand=3, operations="+")]
    rewritten = {"  " + q.upper().replace(" ", " \n\t ", 1) + " " for q in first}
    again = generate_problems(20, seed=1, max_ops=1, max_operand=3, operations="+", exclude=rewritten)
    folded = {" ".join(q.lower().split()) for q in first}
    assert not folded & {" ".join(p["question"].lower().split()) for p in again}
    # and it keeps out what the exact texts keep out, no more
    exact = generate_problems(20, seed=1, max_ops=1, max_operand=3, operations="+", exclude=set(first))
    assert again == exact


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_ops": 3, "max_ops": 2}, "min_ops"),
        ({"min_ops": 0}, "min_ops"),
        ({"max_ops": 7}, "max_ops"),
        ({"max_operand": 1}, "max_operand"),
        ({"min_operand": 0}, "min_operand"),
        ({"min_operand": 9, "max_operand": 5}, "min_operand"),
        ({"max_value": 5, "max_operand": 10}, "max_value"),
        ({"operations": "+%"}, "unknown operation"),
        ({"operations": ""}, "operations"),
        ({"min_ops": 1.5}, "min_ops"),
    ],
)
def test_option_validation(options, message):
    with pytest.raises(ValueError, match=message):
        generate_problems(3, seed=0, **options)


def test_count_validation_and_dead_ends():
    with pytest.raises(ValueError, match="n must be"):
        generate_problems(-1)
    with pytest.raises(ValueError, match="n_train"):
        build_splits(-1, 3)
    # Only halving by 2 with numbers up to 2 cannot make three steps.
    with pytest.raises(ValueError, match="admit"):
        generate_problems(1, seed=0, min_ops=3, max_ops=3, max_operand=2, operations="/")


def _read(path: Path) -> pd.DataFrame:
    return pd.read_parquet(path)


def test_build_dataset_schema(tmp_path):
    paths = build_dataset(tmp_path, n_train=60, n_test=20, seed=4, max_ops=2)
    assert set(paths) == {"train", "test"}
    train, test = _read(tmp_path / "train.parquet"), _read(tmp_path / "test.parquet")
    assert len(train) == 60 and len(test) == 20
    for split, frame in (("train", train), ("test", test)):
        assert tuple(frame.columns) == PROMPT_COLUMNS
        assert set(frame["data_source"]) == {DATA_SOURCE} == {"synthetic/arithmetic"}
        assert set(frame["ability"]) == {"math"}
        for i, row in enumerate(frame.itertuples()):
            prompt = list(row.prompt)
            assert len(prompt) == 1 and prompt[0]["role"] == "user"
            extra = row.extra_info
            assert prompt[0]["content"] == extra["question"] + INSTRUCTION
            assert extra["split"] == split and extra["index"] == i
            assert row.reward_model["style"] == "rule"
            problem = {
                "question": extra["question"],
                "solution": extra["answer"],
                "answer": row.reward_model["ground_truth"],
            }
            check_problem(problem, max_ops=2)
    assert not set(train["extra_info"].map(lambda e: e["question"])) & set(
        test["extra_info"].map(lambda e: e["question"])
    )


def test_build_dataset_is_deterministic_and_guards_existing_files(tmp_path):
    build_dataset(tmp_path / "a", 30, 10, seed=2)
    build_dataset(tmp_path / "b", 30, 10, seed=2)
    for split in ("train", "test"):
        pd.testing.assert_frame_equal(
            _read(tmp_path / "a" / f"{split}.parquet"), _read(tmp_path / "b" / f"{split}.parquet")
        )
    with pytest.raises(FileExistsError):
        build_dataset(tmp_path / "a", 30, 10, seed=3)
    build_dataset(tmp_path / "a", 30, 10, seed=3, overwrite=True)
    assert not _read(tmp_path / "a" / "train.parquet").equals(_read(tmp_path / "b" / "train.parquet"))
    with pytest.raises(ValueError, match="min_ops"):
        build_dataset(tmp_path / "c", 3, 3, min_ops=2, max_ops=1)
    assert not (tmp_path / "c").exists()


def test_cli_writes_both_files(tmp_path, capsys):
    out = tmp_path / "out"
    args = [
        "--output",
        str(out),
        "--n-train",
        "25",
        "--n-test",
        "8",
        "--seed",
        "1",
        "--max-ops",
        "2",
        "--max-operand",
        "9",
        "--operations",
        "+-",
    ]
    assert cli.synthetic(args) == 0
    assert "train: 25 rows" in capsys.readouterr().out
    train = _read(out / "train.parquet")
    assert len(train) == 25 and len(_read(out / "test.parquet")) == 8
    for row in train.itertuples():
        check_problem(
            {
                "question": row.extra_info["question"],
                "solution": row.extra_info["answer"],
                "answer": row.reward_model["ground_truth"],
            },
            max_ops=2,
            max_operand=9,
            operations="+-",
        )
    assert cli.synthetic(args) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli.synthetic(args + ["--overwrite"]) == 0


def _cli_problems(out: Path, *options: str) -> list[dict]:
    """The training problems ``rlhf synthetic`` writes with ``options``, as check_problem takes them."""
    assert cli.synthetic(["--output", str(out), "--n-train", "20", "--n-test", "5", *options]) == 0
    return [{"question": row.extra_info["question"], "solution": row.extra_info["answer"],
             "answer": row.reward_model["ground_truth"]} for row in _read(out / "train.parquet").itertuples()]


def test_cli_seed_chooses_the_problems(tmp_path, capsys):
    written = [p["question"] for p in _cli_problems(tmp_path / "seed3", "--seed", "3")]
    assert written == [p["question"] for p in build_splits(20, 5, seed=3)["train"]]
    assert written != [p["question"] for p in _cli_problems(tmp_path / "seed4", "--seed", "4")]


@pytest.mark.parametrize(
    ("options", "flags", "lowest", "highest"),
    [
        # three steps of + and * on operands up to 20 pass 30 unless --max-value holds every amount to it
        ({"min_ops": 3, "max_ops": 3, "max_operand": 20, "max_value": 30, "operations": "+*"},
         ["--min-ops", "3", "--max-ops", "3", "--max-operand", "20", "--max-value", "30", "--operations", "+*"],
         1, 30),
        # one sum of two numbers in [15, 20] lies in [30, 40]
        ({"max_ops": 1, "min_operand": 15, "max_operand": 20, "operations": "+"},
         ["--max-ops", "1", "--min-operand", "15", "--max-operand", "20", "--operations", "+"], 30, 40),
    ],
    ids=["max-value", "min-operand"],
)
def test_cli_bounds_reach_the_problems(tmp_path, capsys, options, flags, lowest, highest):
    problems = _cli_problems(tmp_path / "out", *flags)
    for problem in problems:
        check_problem(problem, **options)
    assert all(lowest <= int(p["answer"]) <= highest for p in problems)


def test_cli_rejects_bad_options(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.synthetic(
            ["--output", str(tmp_path), "--n-train", "5", "--n-test", "5", "--min-ops", "3", "--max-ops", "1"]
        )
    assert exc.value.code == 2
    assert "min_ops" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.synthetic(["--output", str(tmp_path), "--n-train", "5", "--n-test", "5", "--operations", "x"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:  # an empty split, which the validation and the trainer refuse
        cli.synthetic(["--output", str(tmp_path), "--n-train", "5", "--n-test", "0"])
    assert exc.value.code == 2 and "--n-test must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "train.parquet").exists()


def test_module_entry_point(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf_core.data.synthetic",
            "--output",
            str(tmp_path),
            "--n-train",
            "5",
            "--n-test",
            "3",
            "--seed",
            "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "train.parquet").exists() and (tmp_path / "test.parquet").exists()


def test_module_exports():
    assert synthetic.OPERATIONS == ("+", "-", "*", "/")


def test_defaults_the_same_in_the_library_and_the_command(capsys):
    """The generator's defaults and the ones ``rlhf synthetic --help`` shows are the documented ones."""
    documented = {"min_ops": 1, "max_ops": 3, "min_operand": 1, "max_operand": 20, "max_value": 999,
                  "operations": ("+", "-", "*", "/")}
    assert synthetic.validate_options() == documented
    defaults = {name: parameter.default for name, parameter in
                inspect.signature(synthetic.generate_problems).parameters.items() if name in documented}
    assert defaults == documented
    with pytest.raises(SystemExit):
        cli.synthetic(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for text in ("fewest operations (default 1)", "most operations (default 3)", "smallest operand (default 1)",
                 "largest operand (default 20)", "largest intermediate amount (default 999; 0 for no limit)",
                 "(default '+-*/')"):
        assert text in shown, text
