"""Preference pairs for reward models: the parquet schema, its writer, and two sources of pairs.

A row is ``prompt`` (chat messages, as in the prompt schema), ``chosen`` and ``rejected`` (the
assistant's text, without the end-of-sequence token), ``data_source`` and ``extra_info {split,
index, group, ...}``; ``group`` names the question a pair belongs to, so that a split keeps all
pairs of one question on one side.

Sources:

* ``--gsm8k-solutions FILE``: the real model solutions of the GSM8K release
  (``example_model_solutions.jsonl``: per test question, four models' solutions with an
  ``is_correct`` label). Every (correct, incorrect) pair of solutions to the same question
  becomes a pair; identical pairs (two models wrote the same text) are kept once. These are
  GSM8K **test** questions: a policy that is evaluated on GSM8K test must not be trained
  against a reward model fitted on these pairs, or its score leaks the test set.
* ``--synthetic``: the demo task (:data:`rlhf_core.models.toy.TOY_TASK`): chosen is the worked
  solution with the right final answer, rejected the same working with the demo model's slip
  (:func:`rlhf_core.models.toy.with_slip`: the final line repeats the problem's first number).
* ``--trl FILE ...``: TRL's preference files (:func:`trl_pairs`), split by prompt; rows whose chosen and
  rejected are the same, and rows repeating an earlier row's pair, are left out (counted).

Usage::

    python -m rlhf_core.data.preference --gsm8k-solutions FILE --output DIR [--val-fraction 0.2] [--seed 0]
        [--exclude PATH ...]
    python -m rlhf_core.data.preference --synthetic --output DIR [--n-train 2000] [--n-val 400] [--seed 0]
        [--exclude PATH ...]
    python -m rlhf_core.data.preference --trl FILE [FILE ...] --output DIR [--val-fraction 0.2] [--seed 0]
        [--data-source NAME] [--exclude PATH ...]

writes ``DIR/train.parquet`` and ``DIR/val.parquet``; no question has pairs in both, and neither is empty (the GSM8K
and TRL sources hold at least one question out and keep at least one for training, and refuse pairs on one question
alone). ``--val-fraction`` belongs to the GSM8K and TRL sources, ``--n-train``/``--n-val`` to the synthetic one,
``--data-source`` to TRL's; the other sources refuse them rather than ignore them.

``--exclude`` takes prompt parquet files, or folders of them (their ``*.parquet``), and keeps every pair off
their questions (:func:`prompt_questions`; whitespace collapsed and the case folded): give it the prompts the policy is evaluated on, since a reward
model fitted on pairs of those questions carries them into the PPO reward. The GSM8K source drops such pairs
(and refuses when none is left); the synthetic source draws other questions in their place, so
``--n-train``/``--n-val`` still hold (refused when the demo task runs out of questions). Either says how many
pairs the exclusion took.

Exit status: 0 on success, 1 for unusable input (a missing or unreadable ``--exclude`` path included),
2 when an output exists (without ``--overwrite``) or the command line is wrong.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

if __name__ == "__main__":  # run as `rlhf preference` is (rlhf_core.cli), before the imports below (pandas),
    # so that a Ctrl-C in the command's first seconds ends it with one line and exit 130, not a traceback
    from rlhf_core.cli import _run

    sys.exit(_run("preference", None, "python -m rlhf_core.data.preference"))

import numpy as np
import pandas as pd

from rlhf_core.data.dataset import DataError, prompt_messages
from rlhf_core.data.schema import (
    INSTRUCTION,
    PREFERENCE_COLUMNS,
    is_missing,
    json_message_list,
    plain_value,
    prompt_problem,
    read_rows,
    roles_problem,
    unknown_roles,
    write_parquets_atomic,
)
from rlhf_core.data.validation import question_key

GSM8K_SOURCE = "openai/gsm8k"
GSM8K_MODELS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


class PreferenceDataError(ValueError):
    """Preference input that cannot be used; the message names the file, the row or the columns."""


def make_pair(question: str, chosen: str, rejected: str, data_source: str, split: str, index: int,
              group: str, **extra) -> dict:
    """One preference row; the prompt is the question as the prompt datasets present it."""
    return {
        "prompt": [{"role": "user", "content": question + INSTRUCTION}],
        "chosen": chosen,
        "rejected": rejected,
        "data_source": data_source,
        "extra_info": {"split": split, "index": int(index), "group": group, "question": question, **extra},
    }


# ----------------------------------------------------------------------------- GSM8K model solutions


def as_instructed(solution: str) -> str:
    """A model solution with its closing ``A: <answer>`` line written ``#### <answer>``, the form the prompts'
    instruction asks for (and the policy is rewarded for), so that a reward model learns from the endings it
    will score. Anything else is left as it is."""
    body, _, last = solution.rpartition("\n")
    if not last.startswith("A:"):
        return solution
    return f"{body}\n#### {last[2:].strip()}" if body else f"#### {last[2:].strip()}"


def gsm8k_solution_pairs(path: str | Path) -> list[dict]:
    """Every distinct (correct, incorrect) pair of model solutions to the same question in ``path``.

    Returns ``{question, chosen, rejected, group, chosen_model, rejected_model, answer}`` dicts in file
    order; ``group`` is the line where the question first appears (questions compared as
    :func:`~rlhf_core.data.validation.question_key` compares them), so that a question on two lines keeps all its
    pairs on one side of the split, and a pair two lines share is kept once; the solutions end as the instruction
    asks (:func:`as_instructed`). PreferenceDataError names the line of a malformed row.
    """
    path = Path(path)
    if path.is_dir():
        inside = path / "example_model_solutions.jsonl"
        raise PreferenceDataError(f"{path} is a folder; point --gsm8k-solutions at example_model_solutions.jsonl of "
                                  "the GSM8K release" + (f": {inside}" if inside.is_file() else ""))
    if not path.is_file():
        raise PreferenceDataError(f"{path} does not exist; point --gsm8k-solutions at example_model_solutions.jsonl "
                                  "of the GSM8K release")
    pairs, seen, first_line = [], set(), {}
    with path.open() as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                texts = {"question": row["question"], **{f"{name}.solution": row[name]["solution"]
                                                          for name in GSM8K_MODELS}}
                for field, text in texts.items():  # (a null would fail below without naming its line)
                    if not isinstance(text, str):
                        kind = "null" if text is None else f"of type {type(text).__name__}"
                        raise TypeError(f"{field} is {kind}, not text")
                question = texts["question"]
                solutions = [(name, as_instructed(texts[f"{name}.solution"]), bool(row[name]["is_correct"]))
                             for name in GSM8K_MODELS]
            except (ValueError, KeyError, TypeError) as exc:
                raise PreferenceDataError(
                    f"{path}, line {line_no}: not a model-solutions row ({type(exc).__name__}: {exc}); each line "
                    f"needs 'question' and {', '.join(GSM8K_MODELS)} with 'solution' and 'is_correct'") from exc
            answer = str(row.get("ground_truth", "")).rsplit("A:", 1)[-1].strip().replace(",", "")  # as GSM8K's
            for chosen_model, chosen, chosen_ok in solutions:
                for rejected_model, rejected, rejected_ok in solutions:
                    if not chosen_ok or rejected_ok or chosen == rejected or (question, chosen, rejected) in seen:
                        continue
                    seen.add((question, chosen, rejected))
                    pairs.append({"question": question, "chosen": chosen, "rejected": rejected,
                                  "group": f"line-{first_line.setdefault(question_key(question), line_no)}",
                                  "chosen_model": chosen_model,
                                  "rejected_model": rejected_model, "answer": answer})
    return pairs


def split_by_group(pairs: list[dict], val_fraction: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, val): a seeded ``val_fraction`` of the groups (questions) go to val with all their pairs, at least
    one and at most all but one, so that neither side is empty; PreferenceDataError for fewer than two groups."""
    if not 0 < val_fraction < 1:
        raise PreferenceDataError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    groups = sorted({p["group"] for p in pairs}, key=lambda g: (len(g), g))
    if len(groups) < 2:
        raise PreferenceDataError(f"the pairs are on {len(groups)} question(s): a split by question needs at least "
                                  f"2, one for training and one for validation, whatever --val-fraction "
                                  f"({val_fraction}); add questions with both a correct and an incorrect solution")
    random.Random(f"preference-split-{seed}").shuffle(groups)
    n_val = min(max(1, round(val_fraction * len(groups))), len(groups) - 1)
    val_groups = set(groups[:n_val])
    return [p for p in pairs if p["group"] not in val_groups], [p for p in pairs if p["group"] in val_groups]


# ----------------------------------------------------------------------------- the synthetic demo task


def synthetic_pairs(n_train: int, n_val: int, seed: int = 0, task: dict | None = None,
                    exclude: Iterable[str] = ()) -> tuple[list[dict], list[dict]]:
    """Pairs on the demo task: chosen = the right final answer, rejected = the demo model's slip.

    Train and val questions are distinct (:func:`rlhf_core.data.synthetic.build_splits`), and none is
    in ``exclude`` (the questions of prompt sets the pairs must stay apart from); a problem whose slip
    gives the right answer anyway (first number = result) yields no pair.
    """
    from rlhf_core.data.synthetic import build_splits
    from rlhf_core.models.toy import TOY_TASK, with_slip

    # a stream of its own, apart from the prompt datasets' (synthetic-train-S / synthetic-test-S)
    splits = build_splits(n_train, n_val, seed=f"preference-{seed}", exclude=exclude, **(task or TOY_TASK))
    out = []
    for name in ("train", "test"):
        pairs = []
        for i, problem in enumerate(splits[name]):
            slipped = with_slip(problem)["solution"]
            if slipped.rsplit("####", 1)[1].strip() == problem["answer"]:
                continue
            pairs.append({"question": problem["question"], "chosen": problem["solution"], "rejected": slipped,
                          "group": f"{name}-{i}", "answer": problem["answer"]})
        out.append(pairs)
    return out[0], out[1]


# ----------------------------------------------------------------------------- TRL's preference files


def _message_list(value) -> list | None:
    """``value`` as a list where it is a list of mappings (chat messages, as JSON or parquet give them), else None."""
    if isinstance(value, (list, tuple, np.ndarray)) and len(value) and all(isinstance(m, Mapping) for m in value):
        return list(value)
    return None


def _turns(messages: list, what: str) -> list[dict]:
    """Chat ``messages`` as ``{role, content}`` dicts (other keys left behind); ValueError naming ``what`` where one
    is not a message with text role and content."""
    problem = prompt_problem(messages)
    if problem is not None:
        raise ValueError(problem.replace("prompt", what, 1))
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _reply(value, side: str) -> str:
    """The assistant's reply a ``chosen``/``rejected`` cell holds: a text, or one assistant message (TRL's
    conversational form with an explicit prompt); ValueError saying what the cell holds instead."""
    messages = _message_list(value)
    if messages is None:
        if (problem := response_problem(value)) is not None:
            raise ValueError(f"{side} is {problem}" if problem in ("empty", "blank", "null", "a list")
                             else f"{side} is of type {problem}, not text")
        return value
    turns = _turns(messages, side)
    if len(turns) != 1 or turns[0]["role"] != "assistant":
        raise ValueError(f"{side} holds {len(turns)} message(s) ({', '.join(t['role'] for t in turns)}) after the "
                         "prompt: a reply is one assistant message")
    return _reply(turns[0]["content"], f"{side}'s reply")


def _implicit(chosen, rejected) -> tuple[list[dict], str, str]:
    """(prompt messages, chosen reply, rejected reply) of TRL's implicit-prompt conversational pair: two whole
    conversations whose messages before the last are the same (the prompt), each ending with the assistant's
    reply; ValueError naming what keeps the pair from being split so."""
    sides = {"chosen": _message_list(chosen), "rejected": _message_list(rejected)}
    texts = [side for side, messages in sides.items() if messages is None]
    if texts:
        raise ValueError(f"{' and '.join(texts)} {'is' if len(texts) == 1 else 'are'} not chat messages and there is "
                         "no prompt column: an implicit prompt is read from whole conversations only (text holds "
                         "no turns to tell the prompt from the reply); give a prompt column")
    first, second = (_turns(messages, side) for side, messages in sides.items())
    shared = 0
    while shared < min(len(first), len(second)) and first[shared] == second[shared]:
        shared += 1
    if shared == len(first) == len(second):
        return first, "", ""  # the same conversation twice: left out as identical by the caller
    if shared == 0:
        raise ValueError("chosen and rejected begin with different messages: an implicit prompt is the messages both "
                         "begin with")
    if shared != len(first) - 1 or shared != len(second) - 1:
        raise ValueError(f"chosen and rejected differ before their last message ({len(first)} and {len(second)} "
                         f"messages, {shared} shared): an implicit prompt is all messages but the reply")
    return first[:shared], _reply([first[-1]], "chosen"), _reply([second[-1]], "rejected")


def _read_table(path: Path) -> pd.DataFrame:
    """A parquet, JSON-lines or JSON-array file's rows; PreferenceDataError for another suffix or an unreadable
    file."""
    if path.is_dir():
        raise PreferenceDataError(f"{path} is a folder: name its preference file(s)")
    if not path.is_file():
        raise PreferenceDataError(f"{path} does not exist")
    try:
        if path.suffix == ".parquet":
            return read_rows(path)
        if path.suffix in (".jsonl", ".json"):
            with path.open("rb") as handle:
                start = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
            if start == b"[":  # one JSON array (json.dump, to_json(orient='records')), read as lines it is one row
                return pd.read_json(path, dtype=False)
            try:  # datasets' to_json writes JSON lines whatever the suffix
                return pd.read_json(path, lines=True, dtype=False)
            except ValueError:
                return pd.read_json(path, dtype=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
        raise PreferenceDataError(f"{path} is not a readable {path.suffix[1:]} file ({exc})") from exc
    raise PreferenceDataError(f"{path}: a preference file is .parquet, JSON lines (.jsonl, .json) or a JSON array "
                              "(.json)")


def trl_pairs(path: str | Path) -> tuple[list[dict], int, int, str]:
    """The pairs of one of TRL's preference files (``datasets`` written to parquet, JSON lines or a JSON array):
    ``chosen`` and ``rejected`` in any of TRL's four forms, as text or as chat messages, with a ``prompt`` column
    (text, taken as one user turn, or messages) or without one (conversational only: the messages both
    conversations begin with are the prompt). Returns (pairs as :func:`split_by_group` takes them, each prompt its
    own group; the count of rows left out as their chosen and rejected are the same; the count left out as repeats
    of an earlier pair, which the pipeline's checks refuse; the form read, in words). Messages keep their role and
    content.
    PreferenceDataError names the rows that cannot be read, each with its reason, a cell holding the JSON text of a
    message list among them (taken as text it would train on the JSON)."""
    path = Path(path).expanduser()
    frame = _read_table(path)
    columns = set(frame.columns)
    if {"completion", "label"} <= columns and not {"chosen", "rejected"} <= columns:
        raise PreferenceDataError(f"{path} holds unpaired preferences (prompt, completion, label: TRL's form for KTO); "
                                  "a reward model trains on pairs of a chosen and a rejected reply to one prompt")
    missing = [c for c in ("chosen", "rejected") if c not in columns]
    if missing:
        raise PreferenceDataError(f"{path} is not preference data: it lacks the column(s) {', '.join(missing)} (TRL's "
                                  f"preference columns: prompt, optional, chosen and rejected; its columns: "
                                  f"{', '.join(map(str, frame.columns))})")
    explicit = "prompt" in columns
    pairs, identical, problems, conversational = [], 0, {}, False
    seen, repeated = set(), 0  # (group, chosen, rejected) of the pairs kept; the rows repeating one
    prompts = frame["prompt"] if explicit else [None] * len(frame)
    for row, (prompt, chosen, rejected) in enumerate(zip(prompts, frame["chosen"], frame["rejected"])):
        try:
            for column, cell in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
                if json_message_list(cell):  # as the prompt dataset refuses it
                    raise ValueError(f"{column} is the JSON text of a message list; it would train as one turn "
                                     f"holding the JSON: store the list itself (e.g. frame[{column!r}] = "
                                     f"frame[{column!r}].map(json.loads) before writing the file)")
            if explicit:
                messages = _message_list(prompt)
                if messages is None:
                    if not isinstance(prompt, str):
                        raise ValueError(prompt_problem(prompt))
                    if not prompt.strip():
                        raise ValueError("prompt is blank" if prompt else "prompt is empty")
                    messages = [{"role": "user", "content": prompt}]  # TRL's standard form: the user's text
                messages = _turns(messages, "prompt")
                chosen_text, rejected_text = _reply(chosen, "chosen"), _reply(rejected, "rejected")
            else:
                messages, chosen_text, rejected_text = _implicit(chosen, rejected)
        except ValueError as exc:
            problems.setdefault(str(exc), []).append(row)
            continue
        conversational = conversational or _message_list(chosen) is not None
        if chosen_text == rejected_text:
            identical += 1
            continue
        group = json.dumps(messages, sort_keys=True)
        if (group, chosen_text, rejected_text) in seen:
            repeated += 1
            continue
        seen.add((group, chosen_text, rejected_text))
        users = [m["content"] for m in messages if m["role"] == "user"]
        pairs.append({"question": users[-1] if users else "", "messages": messages, "chosen": chosen_text,
                      "rejected": rejected_text, "group": group})
    if problems:
        count = sum(len(rows) for rows in problems.values())
        shown = "; ".join(f"{problem} in row(s) {', '.join(map(str, rows[:5]))}{' ...' if len(rows) > 5 else ''}"
                          for problem, rows in list(problems.items())[:3])
        raise PreferenceDataError(f"{path}: {count} of {len(frame)} row(s) cannot be read as preference pairs: "
                                  f"{shown}{'; ...' if len(problems) > 3 else ''}")
    roles = roles_problem([(f"row {i}", unknown_roles(p["messages"])) for i, p in enumerate(pairs)])
    if roles is not None:
        raise PreferenceDataError(f"{path}: {roles}")
    form = f"{'conversational' if conversational else 'standard'}, {'explicit' if explicit else 'implicit'} prompt"
    return pairs, identical, repeated, form


# ----------------------------------------------------------------------------- keeping pairs apart from prompt sets


def question_keys(prompt, extra_info=None) -> set[str]:
    """The question a prompt or preference row is about, whitespace collapsed, in each form the row gives it:
    ``extra_info.question`` where it is text, and the last user message without the prompts' instruction
    (:data:`~rlhf_core.data.schema.INSTRUCTION`). Rows written by this project give the same text both ways; a
    prompt file of another source is matched by its last user turn. ``prompt`` must be chat messages
    (:func:`~rlhf_core.data.schema.prompt_problem`), or one string, which the trainer takes as the user turn."""
    prompt = _as_messages(prompt)
    keys = set()
    if isinstance(extra_info, dict) and isinstance(extra_info.get("question"), str):
        keys.add(extra_info["question"])
    users = [m["content"] for m in prompt if m["role"] == "user"]
    if users:
        content = users[-1]
        keys.add(content[:-len(INSTRUCTION)] if content.endswith(INSTRUCTION) else content)
    return {_collapsed(key) for key in keys} - {""}


def _collapsed(text: str) -> str:
    """``text`` with each run of whitespace one space, and none at its ends: how questions are compared."""
    return " ".join(text.split())


def _as_messages(prompt):
    """A prompt cell as the trainer reads it (:func:`~rlhf_core.data.dataset.prompt_messages`: a plain string is one
    user turn); one the trainer refuses is handed back as it is, for :func:`prompt_problem` to say why."""
    try:
        return prompt_messages(prompt, "")
    except DataError:
        return prompt


def prompt_files(paths: Iterable[str | Path]) -> list[Path]:
    """The parquet files named by ``paths``: a file as it is, a folder as the ``*.parquet`` files in it (its
    train/test split). PreferenceDataError for a path that does not exist or a folder without parquet files."""
    files = []
    for path in map(Path, paths):
        path = path.expanduser()
        if path.is_dir():
            found = sorted(path.glob("*.parquet"))
            if not found:
                raise PreferenceDataError(f"{path} holds no .parquet file; name the prompt parquet file(s)")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise PreferenceDataError(f"prompt data {path} does not exist")
    return files


def prompt_questions(paths: Iterable[str | Path], prompt_key: str = "prompt") -> set[str]:
    """The questions (:func:`question_keys`) of prompt parquet files, or folders of them (:func:`prompt_files`):
    what preference pairs must stay apart from; a prompt that is one string is its user turn, as the trainer takes
    it. PreferenceDataError names a file that is not prompt data and the rows whose prompt is neither chat messages
    nor one string."""
    questions: set[str] = set()
    for path in prompt_files(paths):
        try:
            frame = read_rows(path)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
            raise PreferenceDataError(f"{path} is not a readable parquet file ({exc})") from exc
        if prompt_key not in frame.columns:
            raise PreferenceDataError(f"{path} is not prompt data: it has no {prompt_key!r} column (its columns: "
                                      f"{', '.join(map(str, frame.columns))})")
        bad = [(row, problem) for row, prompt in enumerate(frame[prompt_key])
               if (problem := prompt_problem(_as_messages(prompt))) is not None]
        if bad:
            raise PreferenceDataError(f"{path}: {len(bad)} prompt(s) are not chat messages, so their questions "
                                      f"cannot be compared (row {bad[0][0]}: {bad[0][1]})")
        extra = frame["extra_info"] if "extra_info" in frame.columns else [None] * len(frame)
        for prompt, extra_info in zip(frame[prompt_key], extra):
            questions |= question_keys(prompt, extra_info)
    return questions


def drop_questions(pairs: list[dict], questions: set[str]) -> tuple[list[dict], list[dict]]:
    """(kept, dropped): the pairs on none, and on one, of ``questions`` (as :func:`prompt_questions` gives them),
    the case folded on both sides, as the data validation compares questions. A pair's questions are read as
    :func:`check_apart_from_prompts` reads them from the row written (:func:`question_keys`): its ``question`` and
    the last user turn of its prompt without the instruction, so that a TRL pair whose user turn ends with the
    instruction is dropped by the question it asks."""
    folded = {question_key(question) for question in questions}
    kept, dropped = [], []
    for pair in pairs:
        prompt = pair.get("messages", [{"role": "user", "content": pair["question"]}])
        keys = question_keys(prompt, {"question": pair["question"]})
        (dropped if any(question_key(key) in folded for key in keys) else kept).append(pair)
    return kept, dropped


def check_apart_from_prompts(preference_files: Iterable[str | Path], prompt_paths: Iterable[str | Path],
                             what: str = "the evaluation prompts", prompt_key: str = "prompt") -> int:
    """PreferenceDataError when a pair of ``preference_files`` is on a question of the prompt data ``prompt_paths``
    (:func:`prompt_questions`): a reward model fitted on pairs of the evaluation questions carries them into the
    PPO reward, and the evaluation no longer measures held-out questions. Returns the number of pairs checked."""
    prompt_paths = list(prompt_paths)
    # the case folded on both sides, as the data validation compares questions; a pair's question shown as written
    questions = {question_key(question) for question in prompt_questions(prompt_paths, prompt_key)}
    checked, shared, example = 0, 0, None
    for path in preference_files:
        frame = read_preferences(path)
        checked += len(frame)
        for prompt, extra_info in zip(frame["prompt"], frame["extra_info"]):
            found = {key for key in question_keys(prompt, extra_info) if question_key(key) in questions}
            if found:
                shared += 1
                example = example or (Path(path), min(found))
    if shared:
        named = " ".join(str(p) for p in prompt_paths)
        raise PreferenceDataError(
            f"{shared} preference pair(s) are on questions of {what} ({named}), e.g. {example[0]}: "
            f"{example[1][:80]!r}; a reward model fitted on them leaks those questions into the PPO reward. Rebuild "
            f"the pairs with python -m rlhf_core.data.preference ... --exclude {named} --overwrite")
    return checked


# ----------------------------------------------------------------------------- writing and reading


def to_frame(pairs: Iterable[dict], split: str, data_source: str) -> pd.DataFrame:
    rows = []
    for index, pair in enumerate(pairs):
        extra = {k: v for k, v in pair.items() if k not in ("question", "chosen", "rejected", "group", "messages")}
        row = make_pair(pair["question"], pair["chosen"], pair["rejected"], data_source, split, index,
                        pair["group"], **extra)
        if "messages" in pair:  # a prompt as its source wrote it (TRL's files), not a question asked here
            row["prompt"] = pair["messages"]
        rows.append(row)
    return pd.DataFrame(rows, columns=list(PREFERENCE_COLUMNS))


def write_splits(output_dir: str | Path, train: list[dict], val: list[dict], data_source: str,
                 overwrite: bool = False) -> dict[str, Path]:
    """Write ``train.parquet`` and ``val.parquet``, both or neither (:func:`write_parquets_atomic`); both are checked
    before either is written."""
    out = Path(output_dir)
    paths = {"train": out / "train.parquet", "val": out / "val.parquet"}
    if not overwrite:
        existing = [str(p) for p in paths.values() if p.exists()]
        if existing:
            raise FileExistsError(f"{', '.join(existing)} exist(s); pass --overwrite to replace")
    # both or neither, as a stopped run leaves them
    write_parquets_atomic({paths[split]: to_frame(pairs, split, data_source) for split, pairs in
                           (("train", train), ("val", val))}, overwrite)
    return paths


def check_columns(columns: Iterable[str], where: str) -> None:
    """PreferenceDataError naming the missing preference columns of ``where``."""
    missing = [c for c in PREFERENCE_COLUMNS if c not in set(columns)]
    if missing:
        trl = {"chosen", "rejected"} <= set(columns)  # TRL's columns, without this schema's others
        raise PreferenceDataError(
            f"{where} is not a preference file: it lacks the column(s) {', '.join(missing)} (a preference row "
            f"has {', '.join(PREFERENCE_COLUMNS)}); "
            + (f"TRL's preference files convert with python -m rlhf_core.data.preference --trl {where} --output DIR"
               if trl else "write one with python -m rlhf_core.data.preference"))


def read_preferences(path: str | Path) -> pd.DataFrame:
    """A preference parquet, its columns checked (only the schema is read before that check), then its rows: prompts
    that are chat messages (:func:`check_prompts`), and chosen and rejected texts that are not empty or blank (only
    whitespace, as the pipeline's validation refuses them)."""
    import pyarrow.parquet as pq

    path = Path(path).expanduser()
    if path.is_dir():
        raise PreferenceDataError(f"preference file {path} is a folder: name its parquet file(s), e.g. "
                                  "[a.parquet,b.parquet]")
    if not path.is_file():
        raise PreferenceDataError(f"preference file {path} does not exist")
    try:
        columns = pq.read_schema(path).names
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
        raise PreferenceDataError(f"{path} is not a readable parquet file ({exc})") from exc
    check_columns(columns, str(path))
    frame = read_rows(path)
    check_prompts(frame, path)
    for column in ("chosen", "rejected"):
        bad = [(row, problem) for row, text in enumerate(frame[column]) if (problem := response_problem(text))]
        if bad:
            shown = ", ".join(f"{row} ({problem})" for row, problem in bad[:5])
            convert = (f" (TRL's conversational pairs convert with python -m rlhf_core.data.preference --trl {path} "
                       "--output DIR)" if any(problem == "chat messages" for _, problem in bad) else "")
            raise PreferenceDataError(f"{path}: column {column} is not a response's text in row(s) {shown}"
                                      f"{' ...' if len(bad) > 5 else ''}; {column} holds the assistant's reply as "
                                      "one non-blank string, the conversation before it being the prompt's "
                                      f"messages{convert}")
    return frame


def response_problem(value) -> str | None:
    """What keeps a ``chosen`` or ``rejected`` cell from being the assistant's reply as text, in a word or two, or
    None where it is one: empty, blank (whitespace only), null, chat messages (a list of mappings, as TRL's
    conversational pairs hold them), a list, or the name of another type."""
    if isinstance(value, str):
        return None if value.strip() else "blank" if value else "empty"
    if is_missing(value):
        return "null"
    if isinstance(value, (list, tuple, np.ndarray)):
        return "chat messages" if len(value) and all(isinstance(m, Mapping) for m in value) else "a list"
    return type(value).__name__


def check_prompts(frame: pd.DataFrame, where: str | Path) -> None:
    """PreferenceDataError naming, by what is wrong, the first rows (from 0) of ``where`` whose prompt is not chat
    messages (:func:`~rlhf_core.data.schema.prompt_problem`: a non-empty list of ``{role, content}`` string
    messages), or, where all are, whose messages have roles outside the chat format
    (:func:`~rlhf_core.data.schema.roles_problem`), which the chat template writes as text or drops."""
    rows_by_problem: dict[str, list[int]] = {}
    roles: list[tuple[str, list[str]]] = []
    for row, prompt in enumerate(frame["prompt"]):
        problem = prompt_problem(prompt)
        if problem is not None:
            rows_by_problem.setdefault(problem, []).append(row)
        else:
            roles.append((f"row {row}", unknown_roles(prompt)))
    if rows_by_problem:
        count = sum(len(rows) for rows in rows_by_problem.values())
        shown = "; ".join(f"{problem} in row(s) {', '.join(map(str, rows[:5]))}{' ...' if len(rows) > 5 else ''}"
                          for problem, rows in list(rows_by_problem.items())[:3])
        raise PreferenceDataError(f"{where}: {count} prompt(s) are not chat messages ({shown}"
                                  f"{'; ...' if len(rows_by_problem) > 3 else ''}); a prompt is a non-empty list of "
                                  "{'role': ..., 'content': ...} messages with text values")
    unknown = roles_problem(roles)
    if unknown is not None:
        raise PreferenceDataError(f"{where}: {unknown}")


def present_fields(message) -> dict:
    """A message's fields that hold something, at every level (a tool call's fields too): parquet gives every
    mapping of a column each key any of them has (a ``name`` on one message, ``name: None`` on all the others; an
    ``id`` on one tool call, ``id: None`` on the rest), which the chat template renders as absent."""
    return _present(dict(message))


def _present(value):
    """``value`` without the None fields of any mapping in it, however deep."""
    if isinstance(value, Mapping):
        return {key: _present(item) for key, item in value.items() if item is not None}
    if isinstance(value, (list, tuple)):
        return [_present(item) for item in value]
    return value


def canonical_prompt(prompt) -> str:
    """The prompt's messages (their fields that hold something) as sorted-key JSON: what tells train prompts from
    val prompts. Read as the trainer hands them on (:func:`~rlhf_core.data.schema.plain_value`): a list inside a
    message comes from parquet as a NumPy array, which JSON cannot write."""
    return json.dumps([present_fields(plain_value(dict(m))) for m in prompt], sort_keys=True)


def check_preference_files(train: list[Path], val: list[Path]) -> dict:
    """Read every file (:func:`read_preferences`) and check them together (:func:`check_preference_frames`);
    returns counts. PreferenceDataError otherwise."""
    return check_preference_frames([(p, read_preferences(p)) for p in train], [(p, read_preferences(p)) for p in val])


def counts_line(counts: Mapping[str, int]) -> str:
    """The counts :func:`check_preference_files` returns, as a log line says them."""
    held_out = (f", {counts['val_pairs']:,} held out over {counts['val_prompts']:,} prompts" if counts["val_pairs"]
                else ", none held out")
    return f"pairs: {counts['train_pairs']:,} for training over {counts['train_prompts']:,} prompts{held_out}"


def check_preference_frames(train: list[tuple[Path, pd.DataFrame]], val: list[tuple[Path, pd.DataFrame]],
                            keys: Mapping[str, str] | None = None) -> dict:
    """Refuse prompts that are not chat messages (:func:`check_prompts`), pairs whose chosen and rejected are the
    same text, a prompt that has pairs in both train and val, and validation files without a pair; ``train`` and
    ``val`` hold (path, frame) per file. ``keys`` names where each split's files were given (``{"train":
    "reward_model.train.train_files", ...}``): an error about one file starts with it. Returns counts."""
    frames = {"train": train, "val": val}
    for split, items in frames.items():
        where = f"{keys[split]}: " if keys and split in keys else ""
        for path, frame in items:
            check_prompts(frame, f"{where}{path}")
            same = [i for i, (c, r) in enumerate(zip(frame["chosen"], frame["rejected"])) if c == r]
            if same:
                raise PreferenceDataError(f"{where}{path}: chosen and rejected are the same text in row(s) "
                                          f"{', '.join(map(str, same[:5]))}; such a pair teaches nothing, drop it")
    if val and not any(len(frame) for _, frame in val):
        raise PreferenceDataError(f"the validation file(s) {', '.join(str(p) for p, _ in val)} hold no pair: add "
                                  "held-out pairs, or set reward_model.train.val_files=null to train without "
                                  "validation (then no reward_model.train.min_pair_accuracy can be required)")
    prompts = {split: {canonical_prompt(p) for _, f in items for p in f["prompt"]} for split, items in frames.items()}
    shared = prompts["train"] & prompts["val"]
    if shared:
        example = json.loads(next(iter(shared)))[-1]["content"][:80]
        raise PreferenceDataError(f"{len(shared)} prompt(s) have pairs in both the training and the validation "
                                  f"files (e.g. {example!r}); split by question so the held-out accuracy means "
                                  "something")
    return {f"{split}_pairs": sum(len(f) for _, f in items) for split, items in frames.items()} | {
        f"{split}_prompts": len(keys) for split, keys in prompts.items()}
