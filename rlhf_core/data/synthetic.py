"""Synthetic GSM8K-style arithmetic word problems, correct by construction.

Each problem follows one quantity (someone's apples, marbles, ...) through one or more
operations (``+ - * /``) and asks for the final amount::

    Tom has 7 apples. He buys 5 more. How many apples does he have now?

    He has 7 + 5 = <<7+5=12>>12 apples.
    #### 12

Solutions are written in GSM8K's style: one line per step with a ``<<expr=result>>``
calculator annotation, then ``#### answer``. Every intermediate amount stays a positive
integer: a subtraction never reaches zero or below and a division is always exact.

Usage::

    python -m rlhf_core.data.synthetic --output OUT --n-train N --n-test M --seed S \\
        [--min-ops 1] [--max-ops 3] [--min-operand 1] [--max-operand 20] [--max-value 999] \\
        [--operations "+-*/"] [--overwrite]

writes ``OUT/train.parquet`` and ``OUT/test.parquet`` in the schema of
:func:`rlhf_core.data.schema.make_record` with ``data_source="synthetic/arithmetic"``. No question
appears twice, in a split or across the two. The same seed and options give the same files; the
test split does not depend on ``n_train``.

Exit status: 0 on success, 1 for options that admit too few problems, 2 when the output already
exists (and ``--overwrite`` was not given) or the command line is wrong.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

if __name__ == "__main__":  # run as `rlhf synthetic` is (rlhf_core.cli), before the imports below (pandas),
    # so that a Ctrl-C in the command's first seconds ends it with one line and exit 130, not a traceback
    from rlhf_core.cli import _run

    sys.exit(_run("synthetic", None, "python -m rlhf_core.data.synthetic"))

import pandas as pd

from rlhf_core.data.options import SYNTHETIC_DEFAULTS, SYNTHETIC_OPERATIONS
from rlhf_core.data.schema import PROMPT_COLUMNS, make_record, write_parquets_atomic
from rlhf_core.data.validation import question_key

DATA_SOURCE = "synthetic/arithmetic"
OPERATIONS = SYNTHETIC_OPERATIONS
MAX_OPS_LIMIT = 6
# A problem that runs into a dead end (no operation applies) is drawn again; this many dead
# ends in a row means the options admit (almost) no problems.
_MAX_RESTARTS = 1000
# build_dataset stops drawing when this many draws in a row were all duplicates.
_MAX_DUPLICATE_RUN = 20000

_NAMES = (
    ("Tom", "he"),
    ("Anna", "she"),
    ("Ben", "he"),
    ("Lily", "she"),
    ("Sam", "he"),
    ("Mia", "she"),
    ("Jack", "he"),
    ("Emma", "she"),
    ("Leo", "he"),
    ("Zoe", "she"),
    ("Max", "he"),
    ("Ella", "she"),
    ("Noah", "he"),
    ("Ava", "she"),
    ("Luke", "he"),
    ("Ruby", "she"),
    ("Owen", "he"),
    ("Nora", "she"),
    ("Eli", "he"),
    ("Ivy", "she"),
    ("Dan", "he"),
    ("Kate", "she"),
    ("Finn", "he"),
    ("Rosa", "she"),
)
_OBJECTS = (
    ("apple", "apples"),
    ("orange", "oranges"),
    ("marble", "marbles"),
    ("sticker", "stickers"),
    ("book", "books"),
    ("pencil", "pencils"),
    ("cookie", "cookies"),
    ("card", "cards"),
    ("coin", "coins"),
    ("shell", "shells"),
    ("stamp", "stamps"),
    ("balloon", "balloons"),
    ("flower", "flowers"),
    ("candy", "candies"),
    ("egg", "eggs"),
    ("cupcake", "cupcakes"),
    ("crayon", "crayons"),
    ("bead", "beads"),
    ("toy car", "toy cars"),
    ("rock", "rocks"),
)
_CONTAINERS = (("box", "boxes"), ("bag", "bags"), ("pack", "packs"), ("jar", "jars"), ("basket", "baskets"))
_RELATIVES = ("mother", "father", "sister", "brother", "aunt", "uncle", "grandmother", "grandfather")
_PRONOUNS = {
    "he": {"p": "he", "P": "He", "obj": "him", "pos": "his", "refl": "himself"},
    "she": {"p": "she", "P": "She", "obj": "her", "pos": "her", "refl": "herself"},
}

# Sentences for one step; ``{b}`` is the operand, ``{nb}`` the object noun agreeing with it.
_STEP_TEMPLATES = {
    "+": (
        "{P} buys {b} more.",
        "{P} finds {b} more.",
        "{friend} gives {obj} {b} more.",
        "{P} gets {b} more {nb} from {pos} {relative}.",
        "Then {p} picks up {b} more.",
    ),
    "-": (
        "{P} gives away {b}.",
        "{P} loses {b} of them.",
        "{P} sells {b} {nb}.",
        "{P} gives {b} {nb} to {friend}.",
        "Then {p} uses {b} {nb}.",
    ),
    "*": (
        "Then {p} ends up with {b} times as many {objs}.",
        "{P} then has {b} times as many {objs} as before.",
        "The number of {objs} {p} has is then multiplied by {b}.",
    ),
    "/": (
        "{P} splits them into {b} equal piles and keeps one pile.",
        "{P} puts them equally into {b} bags and keeps only one bag.",
        "{P} shares them equally among {b} kids, including {refl}, and keeps {pos} share.",
    ),
}
# Openings of a problem whose first operation is a multiplication: a containers of b objects.
_CONTAINER_OPENINGS = (
    "{name} has {a} {container_a} of {objs}. Each {container} holds {b} {nb}.",
    "{name} buys {a} {container_a} of {objs} with {b} {nb} in each {container}.",
)
_OPENING = "{name} has {a} {na}."
_QUESTIONS = (
    "How many {objs} does {p} have now?",
    "How many {objs} does {name} have at the end?",
    "How many {objs} does {p} have in total now?",
)


def _noun(count: int, forms: tuple[str, str]) -> str:
    return forms[0] if count == 1 else forms[1]


def validate_options(
    min_ops: int = SYNTHETIC_DEFAULTS["min_ops"],
    max_ops: int = SYNTHETIC_DEFAULTS["max_ops"],
    min_operand: int = SYNTHETIC_DEFAULTS["min_operand"],
    max_operand: int = SYNTHETIC_DEFAULTS["max_operand"],
    max_value: int | None = SYNTHETIC_DEFAULTS["max_value"],
    operations: Iterable[str] | str = SYNTHETIC_DEFAULTS["operations"],
) -> dict:
    """Check the generator options and return them normalised (``operations`` as a tuple).

    Raises ValueError naming the offending option.
    """
    for name, value in (
        ("min_ops", min_ops),
        ("max_ops", max_ops),
        ("min_operand", min_operand),
        ("max_operand", max_operand),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if min_ops < 1:
        raise ValueError(f"min_ops must be at least 1, got {min_ops}")
    if max_ops > MAX_OPS_LIMIT:
        raise ValueError(f"max_ops must be at most {MAX_OPS_LIMIT}, got {max_ops}")
    if min_ops > max_ops:
        raise ValueError(f"min_ops ({min_ops}) must not exceed max_ops ({max_ops})")
    if min_operand < 1:
        raise ValueError(f"min_operand must be at least 1, got {min_operand}")
    if max_operand < 2:
        raise ValueError(f"max_operand must be at least 2, got {max_operand}")
    if min_operand > max_operand:
        raise ValueError(f"min_operand ({min_operand}) must not exceed max_operand ({max_operand})")
    if max_value is not None:
        if isinstance(max_value, bool) or not isinstance(max_value, int):
            raise ValueError(f"max_value must be an integer or None, got {max_value!r}")
        if max_value < max_operand:
            raise ValueError(f"max_value ({max_value}) must be at least max_operand ({max_operand})")
    ops = tuple(operations)
    if not ops:
        raise ValueError("operations must name at least one of '+', '-', '*', '/'")
    unknown = sorted(set(ops) - set(OPERATIONS))
    if unknown:
        raise ValueError(f"unknown operation(s) {unknown}; choose from {list(OPERATIONS)}")
    ops = tuple(op for op in OPERATIONS if op in ops)
    return {
        "min_ops": min_ops,
        "max_ops": max_ops,
        "min_operand": min_operand,
        "max_operand": max_operand,
        "max_value": max_value,
        "operations": ops,
    }


def _operand_choices(op: str, cur: int, opts: dict) -> list[int]:
    """The operands ``b`` for which ``cur op b`` is a valid step (positive, exact, within bounds)."""
    low, high, cap = opts["min_operand"], opts["max_operand"], opts["max_value"]
    if op == "+":
        return [b for b in range(low, high + 1) if cap is None or cur + b <= cap]
    if op == "-":
        return list(range(low, min(high, cur - 1) + 1))
    if op == "*":
        return [b for b in range(max(2, low), high + 1) if cap is None or cur * b <= cap]
    divisors = [b for b in range(max(2, low), high + 1) if cur % b == 0]
    proper = [b for b in divisors if b < cur]
    return proper or divisors


def _apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a // b


def _draw_steps(rng: random.Random, opts: dict) -> tuple[int, list[tuple[str, int, int, int]]] | None:
    """A start amount and steps ``(op, before, operand, after)``, or None at a dead end."""
    start = rng.randint(opts["min_operand"], opts["max_operand"])
    n_ops = rng.randint(opts["min_ops"], opts["max_ops"])
    cur = start
    steps = []
    for _ in range(n_ops):
        order = list(opts["operations"])
        rng.shuffle(order)
        for op in order:
            choices = _operand_choices(op, cur, opts)
            if choices:
                b = rng.choice(choices)
                after = _apply(op, cur, b)
                steps.append((op, cur, b, after))
                cur = after
                break
        else:
            return None
    return start, steps


def _render(rng: random.Random, start: int, steps: list[tuple[str, int, int, int]]) -> dict:
    name, gender = rng.choice(_NAMES)
    pron = _PRONOUNS[gender]
    forms = rng.choice(_OBJECTS)
    friend = rng.choice([other for other, _ in _NAMES if other != name])
    relative = rng.choice(_RELATIVES)
    fields = {**pron, "name": name, "objs": forms[1], "friend": friend, "relative": relative}

    sentences = []
    first_op, _, first_b, _ = steps[0]
    rest = steps
    if first_op == "*" and start >= 2 and rng.random() < 0.5:
        container = rng.choice(_CONTAINERS)
        sentences.append(
            rng.choice(_CONTAINER_OPENINGS).format(
                **fields,
                a=start,
                container_a=_noun(start, container),
                container=container[0],
                b=first_b,
                nb=_noun(first_b, forms),
            )
        )
        rest = steps[1:]
    else:
        sentences.append(_OPENING.format(**fields, a=start, na=_noun(start, forms)))
    for op, _, b, _ in rest:
        sentences.append(rng.choice(_STEP_TEMPLATES[op]).format(**fields, b=b, nb=_noun(b, forms)))
    sentences.append(rng.choice(_QUESTIONS).format(**fields))

    lines = []
    for i, (op, before, b, after) in enumerate(steps):
        verb = "keeps" if op == "/" else "has"
        subject = pron["P"] if i == 0 else f"Then {pron['p']}"
        lines.append(
            f"{subject} {verb} {before} {op} {b} = <<{before}{op}{b}={after}>>{after} {_noun(after, forms)}."
        )
    answer = str(steps[-1][3])
    lines.append(f"#### {answer}")
    return {"question": " ".join(sentences), "solution": "\n".join(lines), "answer": answer}


def iter_problems(seed: int, **options) -> Iterator[dict]:
    """An endless, seeded stream of problems ``{question, solution, answer}`` (duplicates possible).

    ``options`` are those of :func:`validate_options`.
    """
    opts = validate_options(**options)
    rng = random.Random(seed)
    while True:
        for _ in range(_MAX_RESTARTS):
            drawn = _draw_steps(rng, opts)
            if drawn is not None:
                break
        else:
            raise ValueError(f"the options {opts} admit (almost) no problems: every draw hit a dead end")
        yield _render(rng, *drawn)


def generate_problems(
    n: int,
    seed: int = 0,
    min_ops: int = SYNTHETIC_DEFAULTS["min_ops"],
    max_ops: int = SYNTHETIC_DEFAULTS["max_ops"],
    min_operand: int = SYNTHETIC_DEFAULTS["min_operand"],
    max_operand: int = SYNTHETIC_DEFAULTS["max_operand"],
    max_value: int | None = SYNTHETIC_DEFAULTS["max_value"],
    operations: Iterable[str] | str = SYNTHETIC_DEFAULTS["operations"],
    unique: bool = False,
    exclude: Iterable[str] = (),
) -> list[dict]:
    """``n`` problems ``{question, solution, answer}``, the same for the same seed and options.

    Each has ``min_ops`` to ``max_ops`` operations drawn from ``operations``; every operand lies in
    ``[min_operand, max_operand]`` (multipliers and divisors are at least 2) and every intermediate
    amount in ``[1, max_value]``. With ``unique`` no question repeats; questions in ``exclude`` are
    never returned (either way, ValueError if the options cannot supply enough distinct ones). Questions are
    compared as the data validation compares them (:func:`~rlhf_core.data.validation.question_key`: whitespace
    collapsed, the case folded), so an excluded question written in other case or spacing stays out too.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    stream = iter_problems(
        seed,
        min_ops=min_ops,
        max_ops=max_ops,
        min_operand=min_operand,
        max_operand=max_operand,
        max_value=max_value,
        operations=operations,
    )
    excluded = {question_key(question) for question in exclude}
    if not unique and not excluded:
        return [next(stream) for _ in range(n)]
    return _take_distinct(stream, n, excluded, dedupe=unique)


def _take_distinct(stream: Iterator[dict], n: int, excluded: set[str], dedupe: bool = True) -> list[dict]:
    """``n`` problems of ``stream`` whose question's :func:`~rlhf_core.data.validation.question_key` is not in
    ``excluded`` (keys), nor, with ``dedupe``, that of a problem taken before."""
    seen = set(excluded)
    out: list[dict] = []
    misses = 0
    while len(out) < n:
        problem = next(stream)
        question = question_key(problem["question"])
        if question in seen:
            misses += 1
            if misses >= _MAX_DUPLICATE_RUN:
                raise ValueError(
                    f"only {len(out)} distinct problems found before {_MAX_DUPLICATE_RUN} duplicates in a row; "
                    "widen the options (more operations, larger max_operand, more steps) or ask for fewer"
                )
            continue
        misses = 0
        if dedupe:
            seen.add(question)
        out.append(problem)
    return out


def split_seeds(seed: int) -> tuple[str, str]:
    """The generator seeds of the train and test streams derived from one dataset seed."""
    return f"synthetic-train-{seed}", f"synthetic-test-{seed}"


def build_splits(n_train: int, n_test: int, seed: int = 0, exclude: Iterable[str] = (),
                 **options) -> dict[str, list[dict]]:
    """Distinct train and test problems with no question shared between them, nor with ``exclude``.

    Questions are compared as the data validation compares them (whitespace collapsed, the case folded:
    :func:`~rlhf_core.data.validation.question_key`), so that ``exclude`` taken from a prompt file that writes a
    question in other letters' case still keeps it out. The test problems come from their own stream, so they do
    not change with ``n_train``. Only the wording is kept apart: a test problem may ask a training problem's
    arithmetic (the same numbers and operations) in other words, as most do where the options allow few sums
    (one operation on numbers up to 12: every one of the demo's test problems).
    """
    for name, value in (("n_train", n_train), ("n_test", n_test)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    train_seed, test_seed = split_seeds(seed)
    excluded = {question_key(question) for question in exclude}
    test = _take_distinct(iter_problems(test_seed, **options), n_test, excluded)
    train = _take_distinct(iter_problems(train_seed, **options), n_train,
                           excluded | {question_key(p["question"]) for p in test})
    return {"train": train, "test": test}


def build_dataset(
    output_dir: str | Path,
    n_train: int,
    n_test: int,
    seed: int = 0,
    overwrite: bool = False,
    **options,
) -> dict[str, Path]:
    """Write ``train.parquet`` and ``test.parquet`` under ``output_dir``; returns their paths.

    ``options`` go to the generator (see :func:`generate_problems`). Existing files are kept
    (FileExistsError) unless ``overwrite``; both are checked before either is written.
    """
    validate_options(**options)
    out = Path(output_dir)
    paths = {split: out / f"{split}.parquet" for split in ("train", "test")}
    if not overwrite:
        existing = [str(p) for p in paths.values() if p.exists()]
        if existing:
            raise FileExistsError(f"{', '.join(existing)} exist(s); pass --overwrite to replace")
    splits = build_splits(n_train, n_test, seed, **options)
    frames = {}
    for split, problems in splits.items():
        rows = [
            make_record(p["question"], p["solution"], p["answer"], split, i, DATA_SOURCE)
            for i, p in enumerate(problems)
        ]
        frames[paths[split]] = pd.DataFrame(rows, columns=list(PROMPT_COLUMNS))
    write_parquets_atomic(frames, overwrite)  # both or neither, as a stopped run leaves them
    return paths
